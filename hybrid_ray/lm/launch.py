"""Start the local run: validate the job file, then train here or re-launch under torchrun.

A plain `python jobs/train_local.py --config X` (no RANK/WORLD_SIZE in the environment) starts
`python -m torch.distributed.run --standalone --nproc_per_node=N -m hybrid_ray.lm ...`, which runs
N copies of this same code with the variables set. Under torchrun or a Ray worker (the variables
already set) it trains directly.
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import List, Optional

import torch.distributed as dist

from hybrid_ray.config import ConfigError
from hybrid_ray.lm.job import Job, load_job

EXIT_FAILED, EXIT_CONFIG = 1, 2
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def parser(prog: str = "train_local.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a byte-level GPT on the Python "
                                "standard library's sources with the hybrid_ray engine.")
    p.add_argument("--config", required=True, help="job file: {engine, model, train} sections")
    add_nproc(p)
    return p


def add_nproc(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="data-parallel processes on this machine "
                   "(default 2; ignored under torchrun or Ray, which set the world size)")


def launched() -> bool:
    """True when torchrun or a Ray worker already set up this process as one rank."""
    return "WORLD_SIZE" in os.environ


def main(argv: Optional[List[str]] = None, prog: str = "train_local.py") -> int:
    """Entry point of jobs/train_local.py and `hybrid-ray train`; returns the exit code."""
    args = parser(prog).parse_args(argv)
    return run(args.config, args.nproc)


def run(config: str, nproc: int) -> int:
    """Validate the job file before any process starts, then train; returns the exit code."""
    if nproc < 1:
        print(f"error: --nproc: out of range; got {nproc}; allowed: >= 1", file=sys.stderr)
        return EXIT_CONFIG
    try:
        job = load_job(config)
        # Batch sizes depend on the world size: check them before starting any process.
        job.engine.resolve_batch(int(os.environ.get("WORLD_SIZE", nproc)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if launched() or nproc == 1:
        return run_worker(job)
    return relaunch(config, nproc)


def run_worker(job: Job) -> int:
    """Train as one rank; a failure prints its traceback, then one line naming the rank and
    the error, and returns exit code 1."""
    from hybrid_ray.lm.loop import train  # torch-heavy: not needed to validate or re-launch

    rank = os.environ.get("RANK", "0")
    try:
        train(job)
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure must end in a message and exit 1
        traceback.print_exc()
        print(f"error: rank {rank}: training failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        # The engine sits in reference cycles (its gradient hooks) that hold the process group;
        # left to interpreter shutdown, gloo's teardown sometimes aborts the process (SIGABRT,
        # "terminate called without an active exception") after a successful run.
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def relaunch(config: str, nproc: int) -> int:
    """Run N ranks with torchrun (gloo on CPU, one GPU each on CUDA); returns its exit code."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = dict(os.environ)
    # torchrun would set 1 thread and warn about it; give each rank its share of the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    # The children import hybrid_ray by module name: make that work from a bare checkout too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "hybrid_ray.lm", "--config", str(Path(config).resolve())]
    print(f"launching {nproc} processes: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    code = subprocess.call(cmd, env=env)
    if code != 0:
        print(f"error: training failed (torchrun exit code {code}); the failing rank's error is "
              "above", file=sys.stderr)
        return EXIT_FAILED
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0
