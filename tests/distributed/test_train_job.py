"""jobs/train_local.py end to end: re-launch under torchrun, 2 gloo ranks, exit codes."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_lm_job import TINY

pytestmark = [pytest.mark.dist, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def run_job(tmp_path: Path, job: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return subprocess.run([sys.executable, "jobs/train_local.py", "--config", str(path),
                           "--nproc", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_two_ranks_train_and_agree(tmp_path):
    job = copy.deepcopy(TINY)
    job["engine"]["zero_optimization"]["stage"] = 2
    proc = run_job(tmp_path, job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es) on cpu (gloo)" in proc.stdout
    assert "batch 16 = 8 micro x 1 accumulation x 2 ranks" in proc.stdout
    assert "final: train loss" in proc.stdout and "done in" in proc.stdout
    assert proc.stdout.count("final:") == 1  # rank 0 prints, rank 1 does not


def test_failure_in_a_rank_exits_1_with_a_message(tmp_path):
    job = copy.deepcopy(TINY)
    job["train"]["require_below_baseline"] = True
    job["train"]["steps"] = 1  # one step cannot beat the unigram baseline
    proc = run_job(tmp_path, job)
    assert proc.returncode == 1
    assert "training failed: DidNotLearnError: final val loss" in proc.stderr
    assert "error: training failed (torchrun exit code" in proc.stderr
