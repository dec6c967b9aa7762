"""RunTracker against a real `mlflow server` on loopback: one run per run name across sessions,
everything readable back through MlflowClient, and an outage that loses nothing.

One server per module (it takes several seconds to start here); the outage test stops it and
starts it again on the same port and database.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from hybrid_ray.tracking import RunTracker

pytestmark = pytest.mark.slow
MLFLOW = str(Path(sys.executable).with_name("mlflow"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An `mlflow server` in its own process group, so stopping it stops its workers too."""

    def __init__(self, root: Path):
        self.root, self.port = root, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job runner processes
        cmd = [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.root}/db.sqlite",
               "--artifacts-destination", str(self.root / "artifacts")]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise RuntimeError("mlflow server did not answer /health in 90 s")

    def kill(self) -> None:
        """An abrupt outage: SIGKILL, no graceful shutdown (which can take many seconds)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def _history(client: MlflowClient, run_id: str, key: str) -> list:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                             key=lambda m: (m.timestamp, m.step))]


def _wait_sent(tracker: RunTracker, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while tracker.pending and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tracker.pending == 0, f"{tracker.pending} item(s) still queued"


def test_one_run_per_name_across_sessions(server, tmp_path):
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "optimizer": {"lr": 1e-3}}
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"step": 3}')
    first = RunTracker("job-a", experiment="tracker-test", tracking_uri=server.uri, params=config,
                       tags={"model": "mlp"})
    first.system_metrics(True, interval_s=0.2)
    for step in range(1, 6):
        first.log_metrics({"loss": 1.0 / step, "tokens_per_s": 100.0 * step, "note": "x"}, step)
    first.event("worker 1 lost: resuming", recovery_s=2.5)
    first.log_dict(config, "config.json")
    first.log_artifact(str(manifest), "checkpoints")
    manifest.unlink()  # copied at the call: the upload does not need it any more
    time.sleep(0.5)    # a couple of system samples
    report = first.close("FAILED")
    assert (report.unsent, report.failed, report.dropped) == (0, 0, 0)
    assert first.resumed is False

    # A restarted driver: same run, params compared, replayed steps 4..5 kept once.
    second = RunTracker("job-a", experiment="tracker-test", tracking_uri=server.uri,
                        params={**config, "zero_optimization": {"stage": 3}}, tags={"attempt": 2})
    second.system_metrics(True, interval_s=0.2)
    for step in range(4, 9):
        second.log_metrics({"loss": 1.0 / step}, step)
    second.event("stopped at step 8 to grow to 3 worker(s)")
    time.sleep(0.5)
    report = second.close()
    assert second.run_id == first.run_id and second.resumed is True
    assert report.replayed == 2 and report.unsent == 0

    client = MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name("tracker-test").experiment_id])
    assert [r.info.run_id for r in runs] == [first.run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["zero_optimization.stage"] == "2"
    assert run.data.params["optimizer.lr"] == "0.001"
    assert run.data.tags["param_changed.zero_optimization.stage"] == "3"
    assert run.data.tags["model"] == "mlp" and run.data.tags["attempt"] == "2"
    assert run.data.tags["hybrid_ray.sessions"] == "2"
    assert _history(client, run.info.run_id, "loss") == [(s, 1.0 / s) for s in range(1, 9)]
    assert [s for s, _ in _history(client, run.info.run_id, "tokens_per_s")] == [1, 2, 3, 4, 5]
    assert run.data.metrics["events/count/failure"] == 1.0
    assert run.data.metrics["events/count/resize"] == 1.0
    assert run.data.metrics["events/recovery_s"] == 2.5
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")]
    assert len(steps) >= 2 and sorted(steps) == list(range(len(steps)))  # continued, not restarted

    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "events.log", "checkpoints"} <= files
    out = tmp_path / "down"
    out.mkdir()
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "config.json", str(out))).read_text()) == config
    assert Path(client.download_artifacts(run.info.run_id, "checkpoints/manifest.json", str(out))).read_text() == '{"step": 3}'
    events = Path(client.download_artifacts(run.info.run_id, "events.log", str(out))).read_text().splitlines()
    assert len(events) == 2 and "[failure] worker 1 lost" in events[0] and "[resize]" in events[1]


def test_same_metric_twice_is_stored_once(server):
    # The sender re-sends a batch whose reply was lost; MLflow's SQL store keeps one row per
    # (key, timestamp, step, value), which is what makes that safe.
    client = MlflowClient(server.uri)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    batch = [Metric("loss", 0.5, 1_700_000_000_000, 7), Metric("loss", 0.4, 1_700_000_000_001, 8)]
    client.log_batch(run.info.run_id, metrics=batch)
    client.log_batch(run.info.run_id, metrics=batch)
    assert _history(client, run.info.run_id, "loss") == [(7, 0.5), (8, 0.4)]


def test_outage_loses_nothing(server, caplog):
    caplog.set_level(logging.WARNING, logger="hybrid_ray.tracking")
    tracker = RunTracker("job-outage", experiment="tracker-test", tracking_uri=server.uri,
                         max_backoff_s=1.0)
    for step in range(1, 11):
        tracker.log_metrics({"loss": float(step)}, step)
    _wait_sent(tracker)

    server.stop()
    started = time.monotonic()
    for step in range(11, 31):
        tracker.log_metrics({"loss": float(step), "lr": 0.1}, step)
    tracker.event("worker 0 lost", recovery_s=1.0)
    tracker.log_text("written while the server was down", "notes/outage.txt")
    assert time.monotonic() - started < 1.0, "logging blocked on the dead server"
    time.sleep(2.0)  # several failed attempts
    assert tracker.pending > 0

    server.start()
    _wait_sent(tracker)
    report = tracker.close()
    assert (report.unsent, report.failed, report.dropped) == (0, 0, 0)

    client = MlflowClient(server.uri)
    assert _history(client, tracker.run_id, "loss") == [(s, float(s)) for s in range(1, 31)]
    assert [s for s, _ in _history(client, tracker.run_id, "lr")] == list(range(11, 31))
    assert {a.path for a in client.list_artifacts(tracker.run_id, "notes")} == {"notes/outage.txt"}
    warnings = [r for r in caplog.records if r.name == "hybrid_ray.tracking" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()


def test_close_reports_what_could_not_be_sent():
    # Nothing listens on this port: the tracker never blocks and close() gives up on time.
    tracker = RunTracker("job-nowhere", tracking_uri=f"http://127.0.0.1:{_free_port()}",
                         max_backoff_s=0.2)
    started = time.monotonic()
    for step in range(1, 6):
        tracker.log_metrics({"loss": 1.0, "acc": 0.5}, step)
    assert time.monotonic() - started < 0.5
    report = tracker.close(timeout_s=1.0)
    assert time.monotonic() - started < 5.0
    assert report.sent == 0 and report.unsent == 5 * 2 + 1  # ten values and the final status
    assert tracker.run_id is None
