"""The LM job on a real local Ray: a lost worker is replaced and the run ends exactly where an
uninterrupted one does (data position and RNG included); `jobs/train_lm.py --workers 2` starts
its own local Ray and shows progress."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
from hybrid_ray.lm.elastic import LMTrainFn
from hybrid_ray.lm.placement import place
from tests.unit.test_lm_job import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def job(data: Path, out: Path, steps: int = 16) -> dict:
    raw = copy.deepcopy(TINY)
    raw["engine"]["bf16"] = {"enabled": False}  # fp32: bitwise comparisons across runs
    raw["data"]["path"] = str(data)
    raw["train"].update(steps=steps, eval_interval=8, save_interval=4, out_dir=str(out), sample_tokens=8)
    return place(raw)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from hybrid_ray.data import ensure_prepared
    from hybrid_ray.lm.job import load_job
    path = tmp_path_factory.mktemp("lm_data") / "bytes"
    j = load_job(job(path, tmp_path_factory.mktemp("unused")))
    ensure_prepared(j.data.corpus, j.data.path, j.data.prepare)
    return path


def fit(raw: dict, kill_at: int = None, spares: int = 0, min_workers: int = 1):
    out = raw["train"]["out_dir"]
    scaling = ScalingConfig(min_workers=min_workers, max_workers=2, spare_workers=spares)
    trainer = ElasticTrainer(LMTrainFn(raw), scaling,
                             FailureConfig(max_failures=2, collective_timeout_s=10.0),
                             storage_path=os.path.dirname(out), run_name=os.path.basename(out))
    if kill_at is None:
        return trainer.fit()
    return fit_killing(trainer, lambda c: c._last_step >= kill_at, victim=1)


def fit_killing(trainer: ElasticTrainer, ready, victim: int):
    """trainer.fit(), with member `victim`'s actor killed once ready(controller) says so."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", trainer.fit()))
    t.start()
    import ray
    deadline = time.monotonic() + 200
    while trainer.controller is None or not ready(trainer.controller):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray.kill(trainer.controller.group.members[victim].handle, no_restart=True)
    t.join(400)
    return box["r"]


def test_lost_worker_is_replaced_and_the_lm_run_ends_as_an_uninterrupted_one(ray_session, data, tmp_path):
    plain = fit(job(data, tmp_path / "plain"))
    killed = fit(job(data, tmp_path / "killed"), kill_at=6)
    assert plain.world_sizes == [2] and killed.world_sizes == [2, 2], killed.events
    assert killed.failures == 1
    assert killed.value.steps == plain.value.steps == 16
    assert killed.value.val_loss == plain.value.val_loss  # bitwise: same data, RNG and math
    steps = [r["step"] for r in killed.records if "train_loss" in r]
    assert steps[-1] == 16


def test_train_lm_script_starts_a_local_ray_and_reports_progress(data, tmp_path):
    cfg = tmp_path / "tiny.json"
    import json
    cfg.write_text(json.dumps(job(data, tmp_path / "run", steps=8)))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "train_lm.py"), "--config", str(cfg),
                           "--workers", "2"], capture_output=True, text=True, env=env, timeout=400,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "run run: 2-2 CPU worker(s)" in proc.stdout
    assert "step 8/8" in proc.stdout and "workers 2" in proc.stdout
    assert "done: 8 steps" in proc.stdout


def test_resubmitted_job_resumes_after_the_driver_is_lost(data, tmp_path):
    """The driver (and the local Ray it started) killed mid-run; the same command again resumes
    from the newest committed checkpoint instead of starting over."""
    import json
    import signal
    cfg = tmp_path / "tiny.json"
    raw = job(data, tmp_path / "run", steps=24)
    raw["train"]["save_interval"] = 2
    cfg.write_text(json.dumps(raw))
    cmd = [sys.executable, str(ROOT / "jobs" / "train_lm.py"), "--config", str(cfg), "--workers", "2"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, cwd=tmp_path, start_new_session=True)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.exists():
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the driver and everything it started
    first.wait()
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resume: " in second.stdout, second.stdout[-3000:]
    assert "done: 24 steps" in second.stdout


def test_a_run_that_did_not_learn_fails_once_and_is_recorded_failed(data, tmp_path, capsys):
    """The baseline check is the driver's, after the run is recorded: the workers are not
    restarted to evaluate the same weights again, and the MLflow run ends FAILED."""
    from mlflow import MlflowClient

    from hybrid_ray.lm.elastic import run_elastic
    raw = job(data, tmp_path / "lazy", steps=1)
    raw["train"].update(require_below_baseline=True, eval_interval=1, save_interval=1)
    assert run_elastic(raw, 2, 2, max_failures=2) == 1
    out = capsys.readouterr()
    assert "error: final val loss" in out.err and "not below the unigram baseline" in out.err
    assert "done: 1 steps" in out.out and "0 failure(s)" in out.out, out.out[-2000:]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([client.get_experiment_by_name("hybrid_ray").experiment_id])
    assert run.info.status == "FAILED"
