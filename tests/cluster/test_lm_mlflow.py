"""The LM job on Ray recorded in a real MLflow server: one worker killed mid-run leaves exactly
one run, each step's metrics once and in order, with params, events, artifacts and the worker
node's system metrics; the server stopped mid-run and restarted loses no metric."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from hybrid_ray.lm.elastic import run_elastic
from tests.cluster.test_lm_on_ray import data, job  # noqa: F401 - data is a fixture
from tests.cluster.test_mlflow_tracker import server  # noqa: F401 - a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 16


def test_killed_worker_leaves_one_mlflow_run_with_every_step_once(ray_session, server, data, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    raw = job(data, tmp_path / "lm-mlflow", steps=STEPS)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("code", run_elastic(raw, 1, 2, max_failures=2)))
    t.start()
    ray = ray_session
    deadline = time.monotonic() + 300
    while True:  # kill worker 1 once training is under way (its first checkpoint written)
        assert time.monotonic() < deadline and t.is_alive()
        if (tmp_path / "lm-mlflow" / "checkpoints" / "latest").exists():
            try:
                ray.kill(ray.get_actor("hybrid_ray:lm-mlflow:worker1"), no_restart=True)
                break
            except ValueError:
                pass
        time.sleep(0.2)
    t.join(400)
    assert box["code"] == 0

    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("hybrid_ray")
    runs = client.search_runs([exp.experiment_id], "tags.`hybrid_ray.run_name` = 'lm-mlflow'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    steps = [m.step for m in sorted(history, key=lambda m: m.timestamp)]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # each step once, in order
    assert run.data.params["engine.zero_optimization.stage"] == "1"
    assert run.data.params["scaling.max_workers"] == "2"
    assert int(run.data.params["model.num_params"]) > 0 and run.data.params["engine.zero_stage"] == "1"
    keys = set(run.data.metrics)
    assert {"train/loss", "train/lr", "train/skipped_steps", "perf/tokens_per_s", "val/loss"} <= keys, keys
    # Constant by construction in a dense fp32 run: not logged.
    assert not keys & {"train/loss_scale", "comm/compression_ratio", "comm/compress_s",
                       "comm/grad_bytes_sent", "train_loss", "loss_scale"}, keys
    assert client.get_metric_history(run.info.run_id, "final/val_loss")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "elastic/world_size")][0] == 2
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "events.log", "weights", "reports"} <= files, files
    models = client.search_logged_models([exp.experiment_id])  # the exported GPT, once
    assert [(m.name, m.source_run_id) for m in models] == [("model", run.info.run_id)], models
    assert [f.path for f in client.list_artifacts(run.info.run_id, "reports")] == ["reports/flops.txt"]
    events = client.download_artifacts(run.info.run_id, "events.log", str(tmp_path))
    text = open(events).read()
    assert "worker 1 lost" in text and "recovered: step" in text
    assert client.get_metric_history(run.info.run_id, "elastic/recovery_s")[0].value > 0
    # The driver's host, and the worker node (one sampler per node however many workers it has).
    keys = set(run.data.metrics)
    assert "system/cpu_utilization_percentage" in keys
    node_keys = {k for k in keys if k.startswith("system/") and k.count("/") == 2}
    nodes = {k.split("/")[1] for k in node_keys}
    assert len(nodes) == 1 and f"system/{nodes.pop()}/system_memory_usage_megabytes" in node_keys, keys


def _steps_logged(out) -> list:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "train_loss" in r]


def test_server_down_mid_run_loses_no_metric(ray_session, server, data, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="hybrid_ray.tracking")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the job file names the server
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    out, steps = tmp_path / "lm-outage", 48  # long enough to outlast a server restart
    raw = job(data, out, steps=steps)
    raw["tracking"] = {"uri": server.uri, "experiment": "lm-outage-exp"}
    raw["train"].update(eval_interval=16, save_interval=16)
    raw["engine"]["steps_per_print"] = 1  # a train_loss record every step
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("code", run_elastic(raw, 2, 2)))
    t.start()
    deadline = time.monotonic() + 300
    while not _steps_logged(out):  # the run is recording
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.1)
    server.kill()
    down_at = len(_steps_logged(out))
    while len(_steps_logged(out)) < down_at + 3:  # training goes on while the server is down
        assert time.monotonic() < deadline and t.is_alive(), "training stalled without MLflow"
        time.sleep(0.1)
    server.start()
    t.join(400)
    assert box["code"] == 0

    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("lm-outage-exp")
    [run] = client.search_runs([exp.experiment_id], "tags.`hybrid_ray.run_name` = 'lm-outage'")
    assert run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in history] == _steps_logged(out) == list(range(1, steps + 1))
    assert client.get_metric_history(run.info.run_id, "final/val_loss")
    assert any(k.startswith("system/") for k in run.data.metrics)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "unreachable" in warned[0], warned  # the outage was seen, once


def test_server_down_at_the_end_is_completed_by_mlflow_sync(ray_session, server, data, tmp_path,
                                                            monkeypatch):
    """The server dies mid-run and stays down past the end: the job finishes (training never
    waits for MLflow), the unsent records wait in <run folder>/mlflow, and `hybrid-ray mlflow
    sync RUN_DIR` after the server is back sends them: every step once, the model, FINISHED."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out, steps = tmp_path / "lm-late", 24
    raw = job(data, out, steps=steps)
    raw["tracking"] = {"uri": server.uri, "experiment": "lm-late-exp"}
    raw["engine"]["steps_per_print"] = 1
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("code", run_elastic(raw, 2, 2)))
    t.start()
    deadline = time.monotonic() + 300
    while len(_steps_logged(out)) < 3:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.1)
    server.kill()
    t.join(400)
    assert box["code"] == 0 and not t.is_alive()
    assert (out / "mlflow" / "journal.jsonl").exists()
    server.start()
    root = Path(__file__).resolve().parents[2]
    sync = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "mlflow", "sync", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert sync.returncode == 0, sync.stdout + sync.stderr
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("lm-late-exp")
    [run] = client.search_runs([exp.experiment_id], "tags.`hybrid_ray.run_name` = 'lm-late'")
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # each step once
    assert client.get_metric_history(run.info.run_id, "final/val_loss")
    models = client.search_logged_models([exp.experiment_id])
    assert [m.source_run_id for m in models] == [run.info.run_id]
    again = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "mlflow", "sync", str(out)],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(root)))
    assert again.returncode == 0 and "nothing to send" in again.stdout, again.stdout + again.stderr
