"""The LM driver's router and the end of a run: each step's metrics routed once however often a
recovered group replays them; the exported model reaches MLflow even when MLflow uploads it
from where it lies after the call (as it does for files over 256 MiB)."""
from __future__ import annotations

from types import SimpleNamespace

from mlflow import MlflowClient

from hybrid_ray.cluster.records import Metrics, Params
from hybrid_ray.lm.router import RecordRouter, finish_tracking
from hybrid_ray.tracking import RunTracker
from hybrid_ray.tracking import tracker as tracker_mod
from tests.unit.test_checkpoint import make, train


def test_the_exported_model_is_uploaded_from_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's sqlite store puts artifacts under ./mlruns
    monkeypatch.setattr(tracker_mod, "_COPY_LIMIT", 0)  # nothing copied at the call: all read later
    run_dir = tmp_path / "run"
    engine = make()
    train(engine, range(2))
    engine.save_checkpoint(str(run_dir / "checkpoints"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = RunTracker("export", tracking_uri=uri)
    value = SimpleNamespace(val_loss=1.5, unigram_nats=2.5, steps=2, sample="")
    finish_tracking(tracker, str(run_dir), str(run_dir / "checkpoints"), value, 0, [1])
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert [f.path for f in client.list_artifacts(run.info.run_id, "weights")] == ["weights/model.safetensors"]
    assert run.info.status == "FINISHED" and run.data.tags["exported_checkpoint"].endswith("global_step2")
    assert (run_dir / "model" / "model.safetensors").is_file()  # kept beside the checkpoints
    exp = client.get_experiment(run.info.experiment_id)  # opens in MLflow 3's model-training view
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert tracker.where() == (f"MLflow: run {run.info.run_id} (export) in {uri}: `mlflow ui "
                               f"--backend-store-uri {uri}`, then http://127.0.0.1:5000/#/experiments/"
                               f"{exp.experiment_id}/runs/{run.info.run_id}")


class Recorder:
    """Stands in for RunTracker, ProgressReporter and the compression coordinator."""

    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args))


def test_replayed_steps_are_routed_once():
    tracker, progress = Recorder(), Recorder()
    router = RecordRouter(tracker, progress, Recorder())
    first = [Metrics({"step": s, "train_loss": 1.0 / s}, 2) for s in range(1, 7)]
    replay = [Metrics({"step": s, "train_loss": 0.5 / s}, 2) for s in range(5, 9)]  # from step 4
    for rec in first + replay + [Metrics({"step": 8, "final_val_loss": 0.1}, 2), Params({"n": 1})]:
        router(rec)
    logged = [(args[1], dict(args[0])) for name, args in tracker.calls if name == "log_metrics"]
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert logged[4][1]["train/loss"] == 1.0 / 5  # the first arrival wins, under its MLflow name
    assert [args[0]["step"] for name, args in progress.calls if name == "record"] == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert ("log_params", ({"n": 1},)) in tracker.calls


def test_the_exported_lm_is_a_logged_model(tmp_path, monkeypatch):
    import mlflow
    import torch

    from hybrid_ray.engine import Engine
    from hybrid_ray.lm.job import load_job
    from hybrid_ray.lm.setup import build_model
    from tests.unit.test_checkpoint import CFG
    from tests.unit.test_lm_job import tiny_job

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    job = load_job(tiny_job(tmp_path / "data", run_dir))
    gpt = build_model(job, 60, seed=1)  # vocabulary rounded up to model.vocab_multiple
    Engine(gpt, CFG).save_checkpoint(str(run_dir / "checkpoints"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = RunTracker("lm-model", tracking_uri=uri, spool_dir=str(run_dir / "mlflow"))
    value = SimpleNamespace(val_loss=1.5, unigram_nats=2.5, steps=3, sample="")
    finish_tracking(tracker, str(run_dir), str(run_dir / "checkpoints"), value, 0, [1], job=job)
    run = MlflowClient(uri).get_run(tracker.run_id)
    (output,) = run.outputs.model_outputs
    assert output.step == 3 and (run_dir / "model" / "model.safetensors").is_file()
    loaded = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    idx = torch.randint(0, 60, (2, 8))
    assert torch.allclose(loaded(idx), gpt.eval()(idx))


def test_spool_dir_and_source_commit(tmp_path):
    import subprocess
    from hybrid_ray.lm.router import spool_dir
    from hybrid_ray.tracking.outputs import source_tags

    assert spool_dir("a", str(tmp_path)) == str(tmp_path / "mlflow")
    assert spool_dir("a", "s3://bucket/runs/a").endswith("/.cache/hybrid_ray/mlflow-spool/a")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_tags()["mlflow.source.git.commit"] == head  # this checkout
    assert source_tags(str(tmp_path)) == {}  # not a checkout (Ray's copy of the working dir): no tag
