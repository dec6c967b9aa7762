"""Scripts that end with `dist.barrier(); dist.destroy_process_group()`, or without it as DeepSpeed's
do, exit 0, every time.

Each run is one 2-rank job as a user starts it: two processes of exit_script.py with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, the engines built by hybrid_ray.initialize and
left alive in the script's globals. Runs go three at a time (six processes on the suite's two
cores: the load under which the exits used to abort), spread over ZeRO-2, ZeRO-3 units, top-k
compression, several engines in one process (stages 0-3, top-k, PowerSGD) and delayed offload
with an asynchronous checkpoint still being written at the end. Every process must exit 0: no
SIGABRT (-6), and (exit_script's own check, 3) no gloo thread alive when the interpreter
starts its teardown.

HYBRID_RAY_EXIT_RUNS=N sets the number of runs per mode (default 10: 50 runs, 100 exits).
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from hybrid_ray.engine.topology import loopback_interface
from tests.distributed.spawn import rendezvous_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("exit_script.py")
MODES = ("zero2", "zero3", "topk", "multi", "offload")
RUNS_PER_MODE = int(os.environ.get("HYBRID_RAY_EXIT_RUNS", "10"))
AT_ONCE = 3
TIMEOUT_S = 300

Run = Tuple[str, List[subprocess.Popen]]


def start(mode: str, out: Path) -> Run:
    """Both ranks of one job, as separate processes."""
    port = rendezvous_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        lo = loopback_interface()
        if lo is not None:  # the scripts that start the group themselves stay on loopback too
            env.setdefault("GLOO_SOCKET_IFNAME", lo)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), mode, str(out)], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return mode, procs


def finish(run: Run, codes: Dict[Tuple[str, int], int], failures: List[str]) -> None:
    mode, procs = run
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        codes[(mode, proc.returncode)] += 1
        if proc.returncode != 0:
            failures.append(f"--- {mode} rank {rank}: exit {proc.returncode}\n"
                            f"{output.decode(errors='replace')[-3000:]}")


def run_all(jobs: List[str], tmp_path: Path) -> None:
    codes: Dict[Tuple[str, int], int] = collections.Counter()
    failures: List[str] = []
    running: List[Run] = []
    t0 = time.monotonic()
    for i, mode in enumerate(jobs):
        if len(running) == AT_ONCE:
            finish(running.pop(0), codes, failures)
        running.append(start(mode, tmp_path / f"run{i}"))
    for run in running:
        finish(run, codes, failures)
    summary = ", ".join(f"{m} exit {rc}: {n}" for (m, rc), n in sorted(codes.items()))
    print(f"{len(jobs)} runs, {2 * len(jobs)} exits in {time.monotonic() - t0:.0f} s: {summary}")
    assert not failures, f"{len(failures)} of {2 * len(jobs)} exits failed ({summary}):\n" + \
        "\n".join(failures[:4])


def test_scripts_exit_cleanly(tmp_path: Path) -> None:
    run_all([mode for _ in range(RUNS_PER_MODE) for mode in MODES], tmp_path)


def test_deepspeed_style_compiled_scripts_exit_cleanly(tmp_path: Path) -> None:
    """engine.compile() at ZeRO 3 and no destroy_process_group() at the end, as DeepSpeed's
    tests/torch_compile/test_compile.py: hybrid_ray made the group, so it ends it at exit. Left
    to module teardown, gloo's threads ran on into the interpreter's teardown (exit_script's
    check, 3) and rank 0 once died there with SIGABRT. Two runs: that check is deterministic,
    and each compiles on six processes of two cores."""
    run_all(["compiled"] * 2, tmp_path)
