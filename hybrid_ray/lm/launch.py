"""Start the LM job: validate the job file, prepare the data, then train here or under torchrun.

A plain `python jobs/train_lm.py --config X` (no RANK/WORLD_SIZE in the environment) prepares the
dataset if it is missing, then starts `python -m torch.distributed.run --standalone
--nproc_per_node=N -m hybrid_ray.lm ...`, which runs N copies of this same code with the
variables set. Under torchrun (the variables already set) it trains directly. A Ray worker calls
`hybrid_ray.lm.loop.train(job, RunContext(...))` instead: no argument parsing, no processes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from hybrid_ray.config import ConfigError
from hybrid_ray.config.api import read_json
from hybrid_ray.lm.job import Job, for_world, load_job
from hybrid_ray.lm.placement import place
from hybrid_ray.lm.resubmit import run_name, starting_step
from hybrid_ray.lm.signals import Terminated, ignore_terminate, terminate_raises

EXIT_FAILED, EXIT_CONFIG = 1, 2
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def parser(prog: str = "train_lm.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a GPT with the hybrid_ray engine on a "
                                "token dataset (prepared from the Python standard library by "
                                "default) and print a sample from it.")
    p.add_argument("--config", required=True,
                   help="job file: {engine, model, data, train} sections (jobs/configs/*.json)")
    add_nproc(p)
    add_job_options(p)
    add_ray(p)
    return p


def add_job_options(p: argparse.ArgumentParser) -> None:
    """What changes the job file's run: resuming, overrides, its length."""
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in train.out_dir (if there is one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", dest="overrides",
                   help="override a job file value, e.g. --set engine.bf16.enabled=false "
                        "--set train.out_dir=runs/fp32 (VALUE is JSON, else a string); repeatable")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="run N optimizer steps: train.steps, and the learning-rate schedule's "
                        "total and warm-up steps and the evaluation and checkpoint intervals "
                        "scaled to match (before --set: a value set there stands)")
    p.add_argument("--storage", default=None, metavar="DIR_OR_URI",
                   help="parent folder of the run folder (a path or a pyarrow.fs URI, e.g. "
                        "s3://bucket/runs; default: train.storage, else train.out_dir's parent); "
                        "the embedded MLflow store is DIR/mlflow.db. Under `ray job submit` give "
                        "an absolute path, e.g. --storage \"$PWD/runs\"")
    p.add_argument("--restart", action="store_true",
                   help="start over from step 0 although an MLflow run of this name has "
                        "progress and the run folder no checkpoint (the old MLflow run is kept, "
                        "renamed)")


def add_ray(p: argparse.ArgumentParser) -> None:
    """Flags that run the job on Ray (any of them, or RAY_ADDRESS set, selects Ray)."""
    g = p.add_argument_group("on a Ray cluster (elastic)")
    g.add_argument("--workers", type=int, default=None, help="fixed group size (min = max = N)")
    g.add_argument("--min-workers", type=int, default=None, help="smallest group the run goes on with")
    g.add_argument("--max-workers", type=int, default=None, help="largest group it grows to")
    g.add_argument("--address", default=None, help="Ray cluster address (default RAY_ADDRESS, else "
                   "a local ray.init())")
    g.add_argument("--run-name", default=None, help="name of the run folder under train.out_dir's "
                   "parent; a resubmitted job with the same name resumes")
    g.add_argument("--max-failures", type=int, default=3, help="failures the run recovers from")


def ray_sizes(args: argparse.Namespace) -> Optional[tuple]:
    """(min, max) workers when the command asks for Ray, else None (torchrun)."""
    if args.workers is not None:
        return args.workers, args.workers
    if args.min_workers is None and args.max_workers is None and not args.address \
            and not os.environ.get("RAY_ADDRESS"):
        return None
    lo = args.min_workers or 1
    return lo, args.max_workers or max(lo, args.nproc)


def add_nproc(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="data-parallel processes on this machine "
                   "(default 2; ignored under torchrun or Ray, which set the world size)")


def launched() -> bool:
    """True when torchrun or a Ray worker already set up this process as one rank."""
    return "WORLD_SIZE" in os.environ


def main(argv: Optional[List[str]] = None, prog: str = "train_lm.py") -> int:
    """Entry point of jobs/train_lm.py and `hybrid-ray train`; returns the exit code."""
    args = parser(prog).parse_args(argv)
    sizes = None if launched() else ray_sizes(args)
    if sizes is not None:
        return run_on_ray(args, *sizes)
    return run(args.config, args.nproc, args.resume, args.overrides, args.steps, args.storage,
               args.restart)


def edited_job(config: str, overrides: Sequence[str], steps: Optional[int]) -> dict:
    """The job file with --steps, then --set applied (a value set stands); ConfigError."""
    from hybrid_ray.lm.job import apply_overrides, with_steps

    raw = read_json(Path(config))
    return apply_overrides(with_steps(raw, steps) if steps is not None else raw, overrides)


def run_on_ray(args: argparse.Namespace, min_workers: int, max_workers: int) -> int:
    """The elastic run: a driver here, the ranks on Ray workers (always resuming: elastic runs
    continue from their newest checkpoint after every membership change)."""
    from hybrid_ray.lm.elastic import run_elastic

    try:
        raw = edited_job(args.config, args.overrides, args.steps)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return run_elastic(raw, min_workers, max_workers, address=args.address,
                       run_name=args.run_name, max_failures=args.max_failures,
                       storage=args.storage, restart=args.restart)


def run(config: str, nproc: int, resume: bool = False, overrides: Sequence[str] = (),
        steps: Optional[int] = None, storage: Optional[str] = None, restart: bool = False) -> int:
    """Validate the job file before any process starts, say where the run starts, then train;
    returns the exit code."""
    if nproc < 1:
        print(f"error: --nproc: out of range; got {nproc}; allowed: >= 1", file=sys.stderr)
        return EXIT_CONFIG
    try:
        raw = place(edited_job(config, overrides, steps), storage, folder=False)
        job = dataclasses.replace(load_job(raw), path=str(config))
        # Batch sizes depend on the world size: check them before starting any process.
        for_world(job, int(os.environ.get("WORLD_SIZE", nproc)))
        if not launched():  # once, before any rank starts
            starting_step(job, run_name(job), resume, restart)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if launched() or nproc == 1:
        return run_worker(job, resume)
    code = prepare_here(job)
    return code if code else relaunch(config, nproc, resume, overrides, steps, storage)


def prepare_here(job: Job) -> int:
    """Build a missing dataset before the ranks start: its log and errors appear once."""
    from hybrid_ray.data import ensure_prepared

    try:
        ensure_prepared(job.data.corpus, job.data.path, job.data.prepare)
    except (OSError, ValueError) as exc:
        print(f"error: data: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def run_worker(job: Job, resume: bool = False) -> int:
    """Train as one rank (rank 0 records the run in MLflow, as the Ray driver does); a failure
    prints its traceback, then one line naming the rank and the error, and returns exit code 1."""
    from hybrid_ray.lm.router import record_locally

    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    tracker, router = record_locally(job, world) if rank == "0" else (None, None)
    # torchrun stops the other ranks with SIGTERM when one fails: rank 0 then records KILLED.
    with terminate_raises() if tracker is not None else contextlib.nullcontext():
        return _train_rank(job, resume, rank, world, tracker, router)


def _train_rank(job: Job, resume: bool, rank: str, world: int, tracker: Any, router: Any) -> int:
    from hybrid_ray.lm.loop import DidNotLearnError, not_learned, train  # torch-heavy
    from hybrid_ray.lm.router import finish_tracking
    from hybrid_ray.lm.setup import RunContext, checkpoint_dir

    try:
        result = train(job, RunContext(resume=resume, report=router))
        problem = not_learned(job, result)
        if tracker is not None:
            finish_tracking(tracker, job.train.out_dir, checkpoint_dir(job), result, 0, [world],
                            job=job, status="FAILED" if problem else "FINISHED")
            print(tracker.where(), flush=True)
        # A rank that exits 1 before rank 0 has recorded makes torchrun SIGTERM rank 0 mid-way:
        # the run would end KILLED, spooled, instead of FAILED in MLflow. Leave together.
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if problem:
            raise DidNotLearnError(problem)
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure must end in a message and exit 1
        if tracker is not None:  # record how the run ended: torchrun waits before it SIGKILLs
            ignore_terminate()
        traceback.print_exc()
        print(f"error: rank {rank}: training failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        if tracker is not None:
            tracker.close("KILLED" if isinstance(exc, Terminated) else "FAILED")
        return EXIT_FAILED
    finally:
        # The engine sits in reference cycles (its gradient hooks) that hold the process group;
        # left to interpreter shutdown, gloo's teardown sometimes aborts the process (SIGABRT,
        # "terminate called without an active exception") after a successful run.
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def relaunch(config: str, nproc: int, resume: bool = False, overrides: Sequence[str] = (),
             steps: Optional[int] = None, storage: Optional[str] = None) -> int:
    """Run N ranks with torchrun (gloo on CPU, one GPU each on CUDA); returns its exit code."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = dict(os.environ)
    # torchrun would set 1 thread and warn about it; give each rank its share of the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    # The children import hybrid_ray by module name: make that work from a bare checkout too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, env.get("PYTHONPATH")]))
    # --local-addr: the ranks rendezvous at 127.0.0.1, not at the address the host name resolves to.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
           f"--nproc_per_node={nproc}", "-m", "hybrid_ray.lm", "--config", str(Path(config).resolve())]
    cmd += ["--resume"] if resume else []
    cmd += [arg for item in overrides for arg in ("--set", item)]
    cmd += ["--steps", str(steps)] if steps is not None else []
    cmd += ["--storage", storage] if storage is not None else []
    print(f"launching {nproc} processes: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    code = subprocess.call(cmd, env=env)
    if code != 0:
        print(f"error: training failed (torchrun exit code {code}); the failing rank's error is "
              "above", file=sys.stderr)
        return EXIT_FAILED
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0
