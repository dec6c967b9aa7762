"""The LM driver's end of a run: the exported model reaches MLflow even when MLflow uploads it
from where it lies after the call (as it does for files over 256 MiB)."""
from __future__ import annotations

from types import SimpleNamespace

from mlflow import MlflowClient

from hybrid_ray.lm.router import finish_tracking
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
    finish_tracking(tracker, str(run_dir), str(run_dir / "checkpoints"),
                    SimpleNamespace(value=value, failures=0, world_sizes=[1]))
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert [f.path for f in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    assert run.info.status == "FINISHED" and run.data.tags["exported_checkpoint"].endswith("global_step2")
    assert (run_dir / "model" / "model.safetensors").is_file()  # kept beside the checkpoints
