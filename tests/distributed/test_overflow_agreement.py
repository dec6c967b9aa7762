"""One rank's overflow skips the step on every rank (2 gloo ranks, fp16 and bf16, ZeRO 0/1/2).

Rank 1 alone poisons step K: either its loss (every gradient non-finite there) or a single
gradient element that, under ZeRO 1/2, lands in rank 0's shard only, so rank 1's own shard stays
finite and only the agreed overflow flag can tell it to skip. Afterwards both ranks must hold the
same loss scale, skip count and parameters, and the skipped step must have changed nothing.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT, GPT_SIZES
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD, STEPS, K, MICRO = 2, 5, 2, 2
CFG = dataclasses.replace(GPT_SIZES["tiny"], bias=False)

# name -> (precision, stage, accumulation steps, what rank 1 poisons)
SCENARIOS: Dict[str, Tuple[str, int, int, str]] = {
    "fp16_s0_loss": ("fp16", 0, 1, "loss"),
    "fp16_s1_loss": ("fp16", 1, 1, "loss"),
    "fp16_s2_loss": ("fp16", 2, 1, "loss"),
    "fp16_s1_other_shard": ("fp16", 1, 1, "element"),
    "fp16_s2_other_shard": ("fp16", 2, 1, "element"),
    # stage 2 reduces every micro-batch: an inf in the window's first one must survive to the step
    "fp16_s2_acc_other_shard": ("fp16", 2, 2, "element"),
    "bf16_s1_other_shard": ("bf16", 1, 1, "element"),
}


def config(precision: str, stage: int, gas: int) -> dict:
    # fp16 hysteresis 1: the first overflow halves the scale, so agreement on it is visible
    section = {"enabled": True, "hysteresis": 1} if precision == "fp16" else {"enabled": True}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": 1.0, precision: section,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def batch(step: int, k: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * k + rank)
    tokens = torch.randint(0, CFG.vocab_size, (MICRO, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def first_element_of_rank0_shard(engine: Engine) -> nn.Parameter:
    """A parameter whose element 0 is the first element of bucket 0: rank 0's slice under ZeRO 1/2."""
    bucket = engine.spaces[0].buckets[0]
    assert bucket.offsets[0] == bucket.start
    lo, hi = bucket.shard_range(0, engine.spaces[0].num_shards)
    assert lo == bucket.start < hi
    return bucket.params[0]


def params(engine: Engine) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train(rank: int, world: int, out: str) -> None:
    for name, (precision, stage, gas, poison) in SCENARIOS.items():
        torch.manual_seed(0)
        engine = Engine(GPT(CFG), config(precision, stage, gas), topology=Topology.from_environment())
        armed = {"on": False}
        if poison == "element" and rank == 1:
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if not armed["on"]:
                    return grad
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad
            first_element_of_rank0_shard(engine).register_hook(hook)
        records: List[dict] = []
        snaps = {}
        for step in range(STEPS):
            if step == K:
                snaps["before"] = params(engine)
            for k in range(gas):
                bad = step == K and k == 0 and rank == 1
                armed["on"] = bad
                loss = engine(*batch(step, k, rank))
                engine.backward(loss * float("inf") if bad and poison == "loss" else loss)
                armed["on"] = False
                engine.step()
            records.append({"applied": engine.was_step_applied(), "scale": engine.loss_scale,
                            "skipped": engine.skipped_steps, "global": engine.global_steps})
            if step == K:
                snaps["after"] = params(engine)
        snaps["final"] = params(engine)
        torch.save(snaps, Path(out) / f"{name}-r{rank}.pt")
        (Path(out) / f"{name}-r{rank}.json").write_text(json.dumps(records))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("overflow")
    # One spawn for every scenario (start-up costs seconds); ranks that disagree time out, not hang.
    spawn.run(train, WORLD, str(out), timeout_s=120)
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_both_ranks_skip_the_step_and_stay_identical(results: Path, name: str) -> None:
    precision = SCENARIOS[name][0]
    records = [json.loads((results / f"{name}-r{r}.json").read_text()) for r in range(WORLD)]
    snaps = [torch.load(results / f"{name}-r{r}.pt") for r in range(WORLD)]
    assert records[0] == records[1], name
    rec = records[0]
    assert [r["applied"] for r in rec] == [step != K for step in range(STEPS)]
    assert [r["skipped"] for r in rec] == [int(step >= K) for step in range(STEPS)]
    assert [r["global"] for r in rec] == list(range(1, STEPS + 1))
    if precision == "fp16":  # hysteresis 1: halved once, at K, and nowhere else
        assert [r["scale"] for r in rec] == [65536.0 if step < K else 32768.0 for step in range(STEPS)]
    else:
        assert all(r["scale"] == 1.0 for r in rec)
    for r in range(WORLD):
        before, after = snaps[r]["before"], snaps[r]["after"]
        assert all(torch.equal(before[n], after[n]) for n in before), (name, r)  # nothing moved
        assert not all(torch.equal(before[n], snaps[r]["final"][n]) for n in before)  # later steps did
    final0, final1 = snaps[0]["final"], snaps[1]["final"]
    assert all(torch.equal(final0[n], final1[n]) for n in final0), name
