"""The LM job on a real local Ray with 1-bit Adam in its momentum form (the job's ZeRO-2, two workers): a
worker killed after the warm-up is replaced, the run resumes from its checkpoint still past the
warm-up (compressing, variance frozen: no second dense warm-up), every step after the warm-up
sends one bit per element, and it ends trained."""
from __future__ import annotations

import math

import pytest

from tests.cluster.test_lm_on_ray import data, fit, job  # noqa: F401 - data is a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
WARMUP = 4


def test_onebit_momentum_lm_job_survives_a_lost_worker_and_keeps_compressing(ray_session, data, tmp_path):  # noqa: F811
    raw = job(data, tmp_path / "onebit")
    raw["engine"]["zero_optimization"] = {"stage": 2}  # the job's own; "auto" takes the momentum form
    raw["engine"]["gradient_clipping"] = 1.0
    raw["engine"]["steps_per_print"] = 1
    raw["engine"]["gradient_compression"] = {"type": "onebit", "warmup_steps": WARMUP}
    killed = fit(raw, kill_at=9, min_workers=2)
    assert killed.failures == 1 and killed.world_sizes == [2, 2], killed.events
    steps = [r for r in killed.records if "compression_ratio" in r]
    assert sorted({r["step"] for r in steps}) == list(range(1, 17))
    assert all(r["compression_ratio"] >= 20 for r in steps if r["step"] > WARMUP), steps
    assert all(r["compression_ratio"] < 2 for r in steps if r["step"] <= WARMUP), steps
    assert killed.value.steps == 16 and math.isfinite(killed.value.val_loss)
    assert killed.value.val_loss < math.log(257), killed.value.val_loss
