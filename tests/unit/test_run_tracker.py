"""RunTracker's sender against MLflow's SQL store, with failures injected into log_batch: a reply
lost after the server applied the batch, a refused item, a full outage buffer."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from hybrid_ray.config import load_config
from hybrid_ray.tracking import RunTracker, classify, sender as sender_mod
from hybrid_ray.tracking.values import clip, flat_params, key, metric_value

ACTIONS: list = []  # what the next log_batch calls do: "down", "lost" (applied, reply lost)


class FlakyClient(MlflowClient):
    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        action = ACTIONS.pop(0) if ACTIONS else "ok"
        if action == "down":
            raise MlflowException("API request to http://127.0.0.1:1/api failed with exception "
                                  "ConnectionError")  # how MLflow wraps a refused connection
        if any(m.key == "bad" for m in metrics):
            raise MlflowException("metric 'bad' refused", error_code=INVALID_PARAMETER_VALUE)
        out = super().log_batch(run_id, metrics, params, tags, synchronous)
        if action == "lost":
            raise MlflowException("API request to http://127.0.0.1:1/api failed with timeout exception")
        return out


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/db.sqlite"
    MlflowClient(uri).search_experiments()  # create the schema once, up front
    return uri


@pytest.fixture(autouse=True)
def flaky(monkeypatch):
    monkeypatch.setattr(sender_mod, "MlflowClient", FlakyClient)
    ACTIONS.clear()
    yield
    ACTIONS.clear()


def _steps(uri: str, run_id: str, name: str) -> list:
    history = MlflowClient(uri).get_metric_history(run_id, name)
    return [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def test_lost_reply_is_resent_without_duplicates(store_uri):
    ACTIONS.extend(["lost", "lost"])
    tracker = RunTracker("lost-reply", tracking_uri=store_uri, max_backoff_s=0.05,
                         params={"optimizer": {"lr": 0.1}}, tags={"model": "mlp"})
    for step in range(1, 6):
        tracker.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step)
    report = tracker.close()
    assert (report.unsent, report.failed) == (0, 0) and not ACTIONS
    run = MlflowClient(store_uri).get_run(tracker.run_id)
    assert run.data.params == {"optimizer.lr": "0.1"} and run.data.tags["model"] == "mlp"
    assert _steps(store_uri, tracker.run_id, "loss") == [1, 2, 3, 4, 5]
    assert _steps(store_uri, tracker.run_id, "lr") == [1, 2, 3, 4, 5]


def test_refused_item_is_dropped_alone(store_uri, caplog):
    tracker = RunTracker("refused", tracking_uri=store_uri)
    tracker.log_metrics({"loss": 1.0}, 1)
    tracker.log_metrics({"bad": 1.0}, 1)
    tracker.log_metrics({"loss": 0.5}, 2)
    report = tracker.close()
    assert (report.failed, report.unsent) == (1, 0)
    assert _steps(store_uri, tracker.run_id, "loss") == [1, 2]
    assert any(r.levelno == logging.ERROR and "refused" in r.getMessage() for r in caplog.records)


def test_full_buffer_drops_newest_and_warns_once(store_uri, caplog):
    ACTIONS.extend(["down"] * 3)
    tracker = RunTracker("full", tracking_uri=store_uri, max_buffered=5, max_backoff_s=0.05)
    accepted = [tracker.log_metrics({"a": 1, "b": 2, "c": 3}, step) for step in range(1, 4)]
    assert accepted == [True, False, False]
    report = tracker.close()
    assert (report.dropped, report.unsent) == (6, 0)
    assert _steps(store_uri, tracker.run_id, "a") == [1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("buffer full" in w for w in warnings) == 1
    assert sum("unreachable" in w for w in warnings) == 1


def test_events_params_and_default_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    with RunTracker("defaults", params=cfg) as tracker:
        assert tracker.tracking_uri == "sqlite:///mlflow.db"
        tracker.log_metrics({"loss": 2.0, "step": 3}, 3)
        tracker.event("worker 1 lost", recovery_s=4.0, note="spot reclaim")
        tracker.event("resized", kind="resize", step=7)
    assert (tmp_path / "mlflow.db").exists()
    run = MlflowClient("sqlite:///mlflow.db").get_run(tracker.run_id)
    assert run.data.params["zero_optimization.stage"] == "2"
    assert "step" not in run.data.metrics
    assert run.data.metrics["events/count/failure"] == 1.0 and run.data.metrics["events/recovery_s"] == 4.0
    assert run.data.tags["hybrid_ray.last_event"] == "resized"


def test_values():
    assert metric_value(torch.tensor(1.5)) == 1.5 and metric_value(np.float32(2.0)) == 2.0
    assert metric_value(True) == 1.0 and metric_value(3) == 3.0
    assert metric_value(None) is None and metric_value("x") is None
    assert metric_value(torch.ones(2)) is None and metric_value([1.0]) is None
    assert key("loss (train)@1") == "loss _train__1" and len(key("k" * 300)) == 250
    assert clip("abcdef", 5) == "ab..."
    assert flat_params({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1,2]", "d": "None"}
    assert len(flat_params({"long": "x" * 7000})["long"]) == 6000


def test_classify():
    assert classify("worker lost: worker 1 lost; resuming") == "failure"
    assert classify("stopped at step 8 to grow to 3 worker(s)") == "resize"
    assert classify("finished at step 9 with 2 worker(s)") == "info"


def test_run_name_is_checked():
    with pytest.raises(ValueError, match="run_name: invalid"):
        RunTracker("it's")


def test_logging_never_waits(store_uri):
    ACTIONS.extend(["down"] * 1000)
    tracker = RunTracker("never-waits", tracking_uri=store_uri, max_backoff_s=0.05)
    started = time.monotonic()
    for step in range(1, 1001):
        tracker.log_metrics({"loss": 1.0, "lr": 0.1}, step)
    assert time.monotonic() - started < 1.0
    ACTIONS.clear()
    assert tracker.close().unsent == 0
    assert len(_steps(store_uri, tracker.run_id, "loss")) == 1000
