"""The LM job with top-k 0.01 gradient compression (error feedback, density warm-up) and with
1-bit Adam (onebit: its momentum form, "auto" at ZeRO-2, and its gradient form) on 2 gloo ranks through
jobs/train_lm.py: it trains, and once the warm-up is over each rank hands >= 30x fewer gradient
bytes per step to collectives than the dense reduction would (indices and scales counted; >= 20x
for the momentum form, whose served chunks go back in an all_gather too).

How close it ends to the dense run is measured in BENCHMARKS.md ("Gradient compression: LM
quality"), not asserted here: on these short runs it is not within 3%."""
from __future__ import annotations

import json
import math

import pytest

from tests.distributed.test_train_job import run_job
from tests.unit.test_lm_job import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS, WARMUP = 40, 10


@pytest.mark.parametrize("compression, stage, ratio", [
    ({"type": "topk", "topk_ratio": 0.01, "warmup_steps": WARMUP}, 2, 30),
    ({"type": "onebit", "warmup_steps": WARMUP, "form": "gradient"}, 2, 30),
    # the momentum form ("auto" at stages 0-2) also hands each served chunk to an all_gather
    ({"type": "onebit", "warmup_steps": WARMUP}, 2, 20)], ids=["topk", "onebit-gradient", "onebit-momentum"])
def test_compressed_lm_job_trains_and_sends_30x_fewer_bytes(tmp_path, compression, stage, ratio):
    job = tiny_job(tmp_path / "data", tmp_path / "run", steps=STEPS, eval_interval=STEPS, sample_tokens=0)
    job["engine"]["steps_per_print"] = 5
    job["engine"]["zero_optimization"]["stage"] = stage
    job["engine"]["gradient_compression"] = compression
    if compression["type"] == "onebit":
        # 1-bit Adam needs clipping here: unclipped at lr 0.01, its frozen-variance updates
        # diverged on 2 of 4 seeds of this job (final val loss 6.5 and 21.9); clipped at 1.0, 6
        # of 6 seeds ended at 3.07-3.11 (docs/engine.md).
        job["engine"]["gradient_clipping"] = 1.0
    proc = run_job(tmp_path, job, "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "compression_ratio" in r]
    assert steps[0]["step"] <= WARMUP and steps[0]["compression_ratio"] < ratio  # still near-dense
    after = [r for r in steps if r["step"] > WARMUP]
    assert after and all(r["compression_ratio"] >= ratio for r in after), after
    final = [r for r in records if "final_val_loss" in r][-1]["final_val_loss"]
    assert final < math.log(257) - 1.0, final  # from ln(257) = 5.55 at initialisation
