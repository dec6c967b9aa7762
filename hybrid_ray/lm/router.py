"""The LM driver's one place where worker records and membership events go: MLflow calls, the
progress display, and the compression coordinator's input.

Each record kind (hybrid_ray.cluster.records) has one route; the controller only forwards them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional

from hybrid_ray.cluster.compression_driver import CompressionCoordinator
from hybrid_ray.cluster.progress import ProgressReporter
from hybrid_ray.cluster.records import (Event, Interval, LinkProbe, Metrics, Params, Record,
                                        SystemSample, Text)
from hybrid_ray.config.loader import to_plain
from hybrid_ray.config.paths import is_uri
from hybrid_ray.engine.checkpoint.offline import export
from hybrid_ray.lm.job import Job
from hybrid_ray.lm.metric_names import MetricNames
from hybrid_ray.lm.pipeline_model import as_gpt_state
from hybrid_ray.lm.placement import spool_dir
from hybrid_ray.tracking import FlushReport, RunTracker
from hybrid_ray.tracking.outputs import source_tags

log = logging.getLogger("hybrid_ray.lm")


class RecordRouter:
    """Routes every record and event of one run (the trainer's on_record and on_event)."""

    def __init__(self, tracker: RunTracker, progress: Optional[ProgressReporter] = None,
                 coordinator: Optional[CompressionCoordinator] = None,
                 names: Optional[MetricNames] = None):
        """progress: the driver's display (None under torchrun, where rank 0 prints its own
        lines); coordinator: the driver's compression choice (None: no driver to choose);
        names: the metrics' MLflow names and the ones left out (metric_names.py)."""
        self.tracker, self.progress, self.coordinator = tracker, progress, coordinator
        self.names = names or MetricNames()
        self._last_step: Dict[str, int] = {}  # per metric name: the newest step routed
        self._routes: Dict[type, Callable[[Any], None]] = {
            Metrics: self._metrics,
            Params: lambda rec: tracker.log_params(rec.params),
            Text: lambda rec: tracker.log_text(rec.text, rec.name),
            SystemSample: lambda rec: tracker.log_system_metrics(rec.values, rec.node, rec.timestamp_ms),
            LinkProbe: coordinator.on_link if coordinator is not None else lambda rec: None,
            Interval: self._interval,
            Event: lambda rec: self.event(rec.text),  # under torchrun (a Ray driver takes them itself)
        }

    def __call__(self, rec: Record) -> None:
        route = self._routes.get(type(rec))
        if route is None:  # a kind this job does not know: say so, lose nothing else
            log.warning("ignoring a %s record from a worker", getattr(rec, "kind", type(rec).__name__))
            return
        route(rec)

    def event(self, msg: str) -> None:
        if self.progress is not None:
            self.progress.event(msg)
        self.tracker.event(msg)

    def _metrics(self, rec: Metrics) -> None:
        if not self._fresh(rec):
            return
        if self.progress is not None:
            self.progress.record(rec)
        if rec.step is not None:
            self.tracker.log_metrics(self.names(rec), rec.step)

    def _fresh(self, rec: Metrics) -> bool:
        """False for a replay: after a recovery the group redoes the steps since its checkpoint
        and reports them again; each step's numbers are routed once, the first time."""
        if rec.step is None:
            return True
        names = [k for k in rec if k not in ("step", "world_size")]
        new = [k for k in names if self._last_step.get(k, -1) < rec.step]
        for k in new:
            self._last_step[k] = rec.step
        return bool(new) or not names

    def _interval(self, rec: Interval) -> None:
        if self.coordinator is not None:
            self.coordinator.on_interval(rec)  # step timings: compression decisions
        if rec.step is not None:  # compression_id in MLflow shows when the setting changed
            self.tracker.log_metrics(self.names(rec.metrics()), rec.step)


class Untracked:
    """The run's record with `tracking.enabled: false`: every call does nothing."""

    tracking_uri, run_id = "(not recorded)", None

    def log_metrics(self, metrics: Any, step: int, monotonic: bool = True) -> bool:
        return True

    def log_params(self, params: Any) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_system_metrics(self, values: Any, source: str, timestamp_ms: Any = None) -> None: ...
    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None: ...
    def set_tags(self, tags: Any) -> None: ...
    def event(self, text: str, **kwargs: Any) -> None: ...
    def log_model(self, model: Any, name: str = "model", **kwargs: Any) -> None: ...
    def log_dataset(self, *args: Any, **kwargs: Any) -> None: ...

    def close(self, status: str = "FINISHED", timeout_s: float = 0.0) -> FlushReport:
        return FlushReport(sent=0, unsent=0, dropped=0, failed=0, replayed=0)

    def where(self) -> str:
        return "MLflow: nothing recorded (tracking.enabled is false)"


def open_tracker(name: str, job: Job, config: Any, params: Mapping[str, Any]) -> Any:
    """The run's MLflow record (the job's tracking.uri, which placement.py sets to the embedded
    store beside the run folders when nothing else names one, else MLFLOW_TRACKING_URI): the job file as params and as config.json, the launch's own
    `params` (the worker range, the process count), system metrics of this host, the dataset
    as the run's input and the source commit as tags. Records are spooled in
    <out_dir>/mlflow (spool_dir) until MLflow has them. Untracked when the job's
    tracking.enabled is false."""
    if not job.tracking.enabled:
        return Untracked()
    tracker = RunTracker(name, experiment=job.tracking.experiment, tracking_uri=job.tracking.uri,
                         params=config, tags={"hybrid_ray.job": "lm", **source_tags()},
                         spool_dir=spool_dir(name, job.train.out_dir))
    tracker.log_params(dict(params))
    tracker.log_dict(to_plain(config), "config.json")
    log_dataset(tracker, job)
    tracker.system_metrics(True)
    return tracker


def log_dataset(tracker: Any, job: Job) -> None:
    """The job's dataset as the run's input, once it is prepared (its meta.json written): the
    digest is of meta.json's content, which names every shard and its token count."""
    from hybrid_ray.data import read_meta

    meta = read_meta(job.data.path)
    if meta is None:
        return
    stable = {k: v for k, v in meta.items() if k != "python"}  # same data, whichever Python wrote it
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    splits = meta.get("splits", {})
    profile = {f"{split}_tokens": info.get("tokens") for split, info in splits.items()}
    profile["vocab_size"] = meta.get("tokenizer", {}).get("vocab_size")
    name = os.path.basename(job.data.path.rstrip("/")) or "data"
    tracker.log_dataset(name, job.data.path, digest, profile)


def finish_tracking(tracker: RunTracker, out_dir: Optional[str], checkpoints: Optional[str],
                    r: Any, failures: int, world_sizes: List[int], job: Optional[Job] = None,
                    status: str = "FINISHED") -> None:
    """Final numbers (r: the run's RunResult), where the checkpoints are, the exported model;
    then close the run.

    The model is exported into the run folder (`<out_dir>/model/model.safetensors`, kept with
    the checkpoints), or for a run folder on an object store into the spool (a temporary folder
    without one); the file stays until MLflow has it: MLflow uploads a large artifact from where
    it lies, after the call that queued it. With `job` the exported weights are also logged as
    an MLflow LoggedModel (the job's GPT, PyTorch flavour) and the dataset input is logged if it
    was not prepared yet when the run opened."""
    tracker.log_metrics(MetricNames()({"final_val_loss": r.val_loss, "unigram_baseline": r.unigram_nats,
                                       "failures": failures}), r.steps, monotonic=False)
    tracker.set_tags({"checkpoints": str(checkpoints), "world_sizes": str(world_sizes)})
    if r.sample:
        tracker.log_text(r.sample, "sample.txt")
    if out_dir is None or checkpoints is None:  # no run folder: nothing to export
        _close(tracker, status)
        return
    if job is not None:
        log_dataset(tracker, job)  # MLflow keeps one input per dataset: a second call is a no-op
    with _model_folder(out_dir, getattr(tracker, "spool_dir", None)) as folder:
        try:
            out = os.path.join(folder, "model.safetensors")
            # A pipelined run's checkpoint has GPTPipeline's names: exported under GPT's.
            tag, state = export(checkpoints, out, transform=as_gpt_state)
            # "weights/": a run's "model/" is where MLflow lists the logged model's own files.
            tracker.log_artifact(out, "weights")
            tracker.set_tags({"exported_checkpoint": tag})
            if job is not None:
                tracker.log_model(_gpt(job, state), "model", step=r.steps)
        except Exception as exc:  # noqa: BLE001 - a missing export must not fail a finished run
            print(f"warning: model export for MLflow failed: {exc}", file=sys.stderr)
        _close(tracker, status)


def _gpt(job: Job, state: Mapping[str, Any]) -> Any:
    """The job's GPT holding the exported weights (its vocabulary is the checkpoint's)."""
    from hybrid_ray.lm.setup import build_model

    model = build_model(job, int(state["wte.weight"].shape[0]), seed=0)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    if set(missing) - {"head.weight"} or unexpected:  # head.weight is wte.weight (tied)
        raise ValueError(f"the checkpoint does not fit the job's model: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.eval()


def _close(tracker: RunTracker, status: str = "FINISHED") -> None:
    report = tracker.close(status)
    if report.unsent and getattr(report, "spooled_in", None):
        from hybrid_ray.tracking.journal import sync_command

        print(f"warning: {report.unsent} MLflow item(s) not sent yet, kept in {report.spooled_in}: "
              f"`{sync_command(report.spooled_in)}` sends them (or the run's next start)",
              file=sys.stderr)
    elif report.unsent:
        print(f"warning: {report.unsent} MLflow item(s) could not be sent", file=sys.stderr)


def _model_folder(out_dir: str, spool: Optional[str] = None) -> ContextManager[str]:
    """Where the exported model is written: the run folder's model/ when it is local; for a run
    folder on an object store the spool's model/ (kept until sent), else a temporary folder."""
    if is_uri(out_dir) and spool:
        folder = os.path.join(spool, "model")
        os.makedirs(folder, exist_ok=True)
        return contextlib.nullcontext(folder)
    if is_uri(out_dir):
        return tempfile.TemporaryDirectory(prefix="hybrid_ray-model-")
    folder = os.path.join(out_dir, "model")
    os.makedirs(folder, exist_ok=True)
    return contextlib.nullcontext(folder)


def record_locally(job: Job, world_size: int) -> Any:
    """Rank 0's MLflow run under torchrun, in the Ray job's layout; (tracker, router)."""
    from hybrid_ray.lm.resubmit import run_name

    name = run_name(job)
    tracker = open_tracker(name, job, job, {"launch.nproc": world_size})
    return tracker, RecordRouter(tracker, names=MetricNames.for_job(job, fixed_world=True))
