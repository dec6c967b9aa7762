"""The LM job on Ray: the driver validates the job file and prepares the data, then every
worker of every generation runs `hybrid_ray.lm.loop.train` on the group it joined.

Checkpoints and metrics live in the run folder, `<storage>/<run name>` (placement.py): a
resubmitted job with the same run folder resumes from its newest checkpoint, and says from which
step before it starts (resubmit.py). Paths are made absolute on the driver: workers do not share
its working directory.
The records the workers send go through one router (router.py) to MLflow and the progress display.
"""
from __future__ import annotations

import copy
import dataclasses
import posixpath
import sys
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from hybrid_ray.cluster.compression_driver import CompressionCoordinator
from hybrid_ray.cluster.controller import Result, TrainingFailedError
from hybrid_ray.cluster.progress import ProgressReporter
from hybrid_ray.cluster.trainer import ElasticTrainer, cluster_has_gpus, connect
from hybrid_ray.config import ConfigError
from hybrid_ray.config.cluster import FailureConfig, ScalingConfig
from hybrid_ray.data import ensure_prepared
from hybrid_ray.lm.job import Job, console_interval, for_world, load_job
from hybrid_ray.lm.loop import not_learned
from hybrid_ray.lm.metric_names import MetricNames
from hybrid_ray.lm.placement import place
from hybrid_ray.lm.resubmit import starting_step
from hybrid_ray.lm.signals import Terminated, ignore_terminate, terminate_raises
from hybrid_ray.lm.router import RecordRouter, finish_tracking, open_tracker
from hybrid_ray.lm.setup import checkpoint_dir
from hybrid_ray.lm.worker import LMTrainFn
from hybrid_ray.tracking import RunTracker, sampling_interval_s

__all__ = ["LMTrainFn", "driver_job", "run_elastic", "validated"]

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def driver_job(raw: Mapping[str, Any], min_workers: int, max_workers: int) -> Job:
    """Validate the job for every world size the group may take (before anything starts)."""
    job = load_job(raw)
    step = replica_size(job)  # the group is whole replicas
    for world in range(min_workers, max_workers + 1, step):
        for_world(job, world)
    return job


def replica_size(job: Job) -> int:
    """Workers per model replica: the engine's tensor x pipeline parallel sizes."""
    return job.engine.tensor_model_parallel_size * job.engine.pipeline_model_parallel_size


def validated(raw: Mapping[str, Any], min_workers: int, max_workers: int, run_name: Optional[str],
              max_failures: int, use_gpu: Optional[bool], storage: Optional[str] = None
              ) -> Tuple[Dict[str, Any], Job, ScalingConfig, FailureConfig]:
    """Everything checked before the cluster is touched: the settings, the run's places
    (placement.py), the job at every world size, the dataset (built here when missing).
    ConfigError, or OSError/ValueError for data."""
    raw = place(raw, storage, run_name)
    job = load_job(raw)
    scaling = ScalingConfig(min_workers=min_workers, max_workers=max_workers, use_gpu=bool(use_gpu),
                            replica_size=replica_size(job),
                            spare_workers=job.engine.fault_tolerance.spare_workers)
    failure = FailureConfig(max_failures=max_failures)
    job = driver_job(raw, min_workers, max_workers)
    ensure_prepared(job.data.corpus, job.data.path, job.data.prepare)
    return raw, job, scaling, failure


def run_elastic(raw: Mapping[str, Any], min_workers: int, max_workers: int,
                address: Optional[str] = None, run_name: Optional[str] = None,
                max_failures: int = 3, use_gpu: Optional[bool] = None,
                storage: Optional[str] = None, restart: bool = False) -> int:
    """Driver of the LM job on Ray; returns the exit code (0 ok, 1 failed, 2 bad input).
    storage, run_name: where the run folder is (placement.py); restart: see resubmit.py."""
    try:
        raw, job, scaling, failure = validated(raw, min_workers, max_workers, run_name,
                                               max_failures, use_gpu, storage)
        storage, name = posixpath.split(job.train.out_dir)
        starting_step(job, name, resuming=True, restart=restart)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (OSError, ValueError) as exc:
        print(f"error: data: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    connect(address)
    if use_gpu is None:  # the cluster decides: GPU workers where it has GPUs
        scaling = dataclasses.replace(scaling, use_gpu=cluster_has_gpus())
    tracker = open_tracker(name, job, raw, {"scaling.min_workers": scaling.min_workers,
                                            "scaling.max_workers": scaling.max_workers,
                                            "scaling.use_gpu": scaling.use_gpu})
    print(f"run {name}: {min_workers}-{max_workers} {'GPU' if scaling.use_gpu else 'CPU'} worker(s), "
          f"checkpoints and metrics in {job.train.out_dir}; MLflow {tracker.tracking_uri}", flush=True)
    progress = ProgressReporter(total_steps=job.train.steps, log_every=console_interval(job))
    # The coordinator's directives go to the controller the trainer makes when it starts.
    router = _router(lambda directive: trainer.controller.send_directive(directive), tracker,
                     progress, job, MetricNames.for_job(job, fixed_world=min_workers == max_workers))
    trainer = ElasticTrainer(LMTrainFn(raw), scaling, failure, storage_path=storage, run_name=name,
                             address=address, on_record=router, on_event=router.event,
                             node_metrics_interval_s=sampling_interval_s())
    try:
        with terminate_raises():  # `ray job stop`: record KILLED before its SIGKILL (3 s later)
            result = trainer.fit()
    except BaseException as exc:
        ignore_terminate()
        progress.close()
        stopped = isinstance(exc, (Terminated, KeyboardInterrupt))
        tracker.close("KILLED" if stopped else "FAILED", timeout_s=2.0 if stopped else 30.0)
        if stopped:
            print(f"stopped: {exc or type(exc).__name__}; the same command resumes the run from "
                  f"its newest checkpoint", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if not isinstance(exc, TrainingFailedError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    progress.close()
    return _finish(tracker, job, result)  # rank 0 printed the sample (its output reaches here)


def _router(send: Callable[[dict], None], tracker: RunTracker, progress: ProgressReporter,
            job: Job, names: MetricNames) -> RecordRouter:
    """The run's record router; with `gradient_compression.type: auto` its coordinator hands
    the driver's choices to `send` (every worker)."""
    coordinator = CompressionCoordinator(
        job.engine.gradient_compression, send=send, event=lambda msg: router.event(msg),
        tag=lambda setting: tracker.set_tags({"compression.setting": setting}))
    router = RecordRouter(tracker, progress, coordinator, names)
    coordinator.announce()
    return router


def _finish(tracker: RunTracker, job: Job, result: Result) -> int:
    """Record the finished run (FAILED when it did not learn) and say how it ended."""
    r = result.value
    problem = not_learned(job, r)
    finish_tracking(tracker, job.train.out_dir, checkpoint_dir(job), r, result.failures,
                    result.world_sizes, job=job, status="FAILED" if problem else "FINISHED")
    print(f"done: {r.steps} steps, val loss {r.val_loss:.4f} nats/token against a unigram baseline "
          f"of {r.unigram_nats:.4f}; {result.failures} failure(s), world sizes {result.world_sizes}")
    print(tracker.where(), flush=True)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK
