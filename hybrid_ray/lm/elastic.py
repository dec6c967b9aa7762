"""The LM job on Ray: the driver validates the job file and prepares the data, then every
worker of every generation runs `hybrid_ray.lm.loop.train` on the group it joined.

Checkpoints and metrics live in train.out_dir, which is `storage_path/run_name` for the
elastic trainer: a resubmitted job with the same out_dir (run name) resumes from its newest
checkpoint. Paths are made absolute on the driver: workers do not share its working directory.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import posixpath
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from hybrid_ray.lm.job import Job, for_world, load_job

from hybrid_ray.cluster.context import WorkerContext
from hybrid_ray.cluster.context import StopTraining


def _is_uri(path: str) -> bool:
    return "://" in path


def driver_job(raw: Mapping[str, Any], min_workers: int, max_workers: int) -> Job:
    """Validate the job for every world size the group may take (before anything starts)."""
    job = load_job(raw)
    for world in range(min_workers, max_workers + 1):
        for_world(job, world)
    return job


def absolute_paths(raw: Mapping[str, Any], run_name: Optional[str]) -> Dict[str, Any]:
    """The raw job with local data/output paths absolute, and out_dir renamed for run_name."""
    out = copy.deepcopy(dict(raw))
    data, train = dict(out.get("data", {})), dict(out.get("train", {}))
    if isinstance(data.get("path"), str) and not _is_uri(data["path"]):
        data["path"] = os.path.abspath(data["path"])
    out_dir = (train.get("out_dir") or "runs/lm").rstrip("/")
    if run_name:  # same parent folder, the run's own name
        out_dir = posixpath.join(posixpath.dirname(out_dir), run_name)
    train["out_dir"] = out_dir if _is_uri(out_dir) else os.path.abspath(out_dir)
    out["data"], out["train"] = data, train
    return out


@dataclass(frozen=True)
class LMTrainFn:
    """Picklable training function for the workers: the (validated) raw job travels with it."""

    raw: Dict[str, Any]

    def __call__(self, ctx: WorkerContext):
        from hybrid_ray.lm.loop import train  # heavy imports on the worker, not the driver
        from hybrid_ray.lm.setup import RunContext

        import torch

        # The worker set its thread count from its CPU resources: keep it (the loop would
        # otherwise split the machine's cores as if this were the only process on it).
        result = train(load_job(self.raw), RunContext(topology=ctx.topology, resume=True,
                                                      report=ctx.report, on_step=ctx.step_done,
                                                      stop=ctx.agree_to_stop,
                                                      directive=ctx.agree_on_directive,
                                                      threads=torch.get_num_threads()))
        if result.stopped:
            raise StopTraining()
        return result


def run_elastic(raw: Mapping[str, Any], min_workers: int, max_workers: int,
                address: Optional[str] = None, run_name: Optional[str] = None,
                max_failures: int = 3, use_gpu: Optional[bool] = None) -> int:
    """Driver of the LM job on Ray; returns the exit code (0 ok, 1 failed, 2 bad input)."""
    from hybrid_ray.config import ConfigError
    from hybrid_ray.data import ensure_prepared

    from hybrid_ray.config.cluster import ClusterConfigError, FailureConfig, ScalingConfig
    from hybrid_ray.cluster.controller import TrainingFailedError
    from hybrid_ray.cluster.compression_driver import CompressionCoordinator
    from hybrid_ray.cluster.progress import ProgressReporter
    from hybrid_ray.cluster.trainer import ElasticTrainer, _connect

    try:
        scaling = ScalingConfig(min_workers=min_workers, max_workers=max_workers,
                                use_gpu=bool(use_gpu))
        failure = FailureConfig(max_failures=max_failures)
        raw = absolute_paths(raw, run_name)
        job = driver_job(raw, min_workers, max_workers)
        ensure_prepared(job.data.corpus, job.data.path, job.data.prepare)
    except (ConfigError, ClusterConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: data: {exc}", file=sys.stderr)
        return 2
    _connect(address)
    if use_gpu is None:  # the cluster decides: GPU workers where it has GPUs
        import ray
        scaling = dataclasses.replace(scaling, use_gpu=ray.cluster_resources().get("GPU", 0) >= 1)
    storage, name = posixpath.split(job.train.out_dir)
    progress = ProgressReporter(total_steps=job.train.steps)
    tracker = _tracker(name, raw, scaling, job)
    print(f"run {name}: {min_workers}-{max_workers} {'GPU' if scaling.use_gpu else 'CPU'} worker(s), "
          f"checkpoints and metrics in {job.train.out_dir}; MLflow {tracker.tracking_uri}", flush=True)

    coordinator = CompressionCoordinator(
        raw.get("engine", {}).get("gradient_compression", {}),
        send=lambda directive: trainer.controller.send_directive(directive),
        event=lambda msg: on_event(msg), tag=lambda setting: tracker.set_tags({"compression.setting": setting}))

    def on_record(rec: dict) -> None:
        coordinator.record(rec)  # link measurements and step timings: compression decisions
        if "flops_report" in rec:  # the flops profile of one training step, from rank 0
            tracker.log_text(rec["flops_report"], "reports/flops.txt")
            return
        if "params" in rec:  # what only the built model knows (its size), from rank 0
            tracker.log_params(rec["params"])
            return
        if "system_metrics" in rec:  # a worker node's CPU/memory/disk/network/GPU sample
            tracker.log_system_metrics(rec["system_metrics"], rec["node"], rec["timestamp_ms"])
            return
        progress.record(rec)
        if "step" in rec:
            tracker.log_metrics(rec, rec["step"])

    def on_event(msg: str) -> None:
        progress.event(msg)
        tracker.event(msg)

    trainer = ElasticTrainer(LMTrainFn(raw), scaling, failure, storage_path=storage, run_name=name,
                             address=address, on_record=on_record, on_event=on_event,
                             node_metrics_interval_s=_system_interval())
    try:
        result = trainer.fit()
    except BaseException as exc:
        progress.close()
        tracker.close("FAILED")
        if not isinstance(exc, TrainingFailedError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    progress.close()
    _finish_tracking(tracker, job, result)
    r = result.value
    print(f"done: {r.steps} steps, val loss {r.val_loss:.4f} nats/token against a unigram baseline "
          f"of {r.unigram_nats:.4f}; {result.failures} failure(s), world sizes {result.world_sizes}")
    return 0  # rank 0 printed the sample itself (its output reaches this driver)


def _tracker(name: str, raw: Mapping[str, Any], scaling, job: Job):
    """The run's MLflow record (the job's tracking.uri, else MLFLOW_TRACKING_URI, else
    sqlite:///mlflow.db here): the job file as params and an artifact, the worker range, system
    metrics of the driver's host."""
    from hybrid_ray.tracking import RunTracker

    tracker = RunTracker(name, experiment=job.tracking.experiment, tracking_uri=job.tracking.uri,
                         params=raw, tags={"hybrid_ray.job": "lm"})
    tracker.log_params({"scaling.min_workers": scaling.min_workers,
                        "scaling.max_workers": scaling.max_workers, "scaling.use_gpu": scaling.use_gpu})
    tracker.log_dict(dict(raw), "config.json")
    tracker.system_metrics(True)
    return tracker


def _system_interval() -> float:
    """MLflow's sampling interval setting, read here and handed to the workers: their
    processes do not see the driver's environment."""
    from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
    return float(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or 10.0)


def _finish_tracking(tracker, job: Job, result) -> None:
    """Final numbers, where the checkpoints are, the exported model; then close the run."""
    import tempfile

    from hybrid_ray.engine.checkpoint.offline import export

    r = result.value
    tracker.log_metrics({"final_val_loss": r.val_loss, "unigram_baseline": r.unigram_nats,
                         "failures": result.failures}, r.steps, monotonic=False)
    ckpts = job.train.out_dir.rstrip("/") + "/checkpoints"
    tracker.set_tags({"checkpoints": ckpts, "world_sizes": str(result.world_sizes)})
    if r.sample:
        tracker.log_text(r.sample, "sample.txt")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = posixpath.join(tmp, "model.safetensors")
            tag, _ = export(ckpts, out)
            tracker.log_artifact(out, "model")  # copied now: the folder goes away below
            tracker.set_tags({"exported_checkpoint": tag})
    except Exception as exc:  # noqa: BLE001 - a missing export must not fail a finished run
        print(f"warning: model export for MLflow failed: {exc}", file=sys.stderr)
    report = tracker.close("FINISHED")
    if report.unsent:
        print(f"warning: {report.unsent} MLflow item(s) could not be sent", file=sys.stderr)
