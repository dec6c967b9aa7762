"""Bytes per parameter held by each rank follow the ZeRO formulas at 1, 2 and 4 ranks.

Measured from the tensors the engine actually holds (flat buffers, masters, optimizer state),
after real steps with a real gloo group. With Adam and bf16 parameters, between steps:
stage 0: 16 bytes; stage 1: 4 + 12/N; stage 2: 2 + 12/N; stage 3: 14/N (half-precision shard,
fp32 master, two moments); plus the fp32 gradient shard 4/N while a window is being reduced
(stages 2-3 from its first micro-batch on). Stage 3 at one rank runs as stage 2.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT, GPT_SIZES
from tests.distributed import spawn

CFG = dataclasses.replace(GPT_SIZES["small"], bias=False)


def engine_for(stage: int) -> Engine:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200_000,
                                 # partition all but the LayerNorms (0.3% of the parameters)
                                 "stage3_param_persistence_threshold": 1000},
           "precision": {"norms_fp32": False},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    return Engine(GPT(CFG), cfg, topology=Topology.from_environment())


def measure(rank: int, world: int, out: str) -> None:
    results = {}
    for stage in (0, 1, 2, 3):
        engine = engine_for(stage)
        # Counted from the layout: a released stage-3 parameter's data is empty.
        n = sum(shape.numel() for s in engine.spaces for shape in s.shapes.values())
        x = torch.randint(0, CFG.vocab_size, (1, 33))
        for _ in range(2):  # the first step creates the optimizer state
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            during = engine.memory_breakdown()
            engine.step()
        between = engine.memory_breakdown()
        results[stage] = {"n": n, "during": during, "between": between}
    if rank == 0:
        Path(out, f"mem-{world}.json").write_text(json.dumps(results))


def expected(stage: int, world: int) -> dict:
    shards = world if stage >= 1 else 1
    whole_grads = stage < 2 or world == 1
    whole_params = stage < 3 or world == 1
    return {"params": 2 if whole_params else 2 / shards, "grads": 2 if whole_grads else 0,
            "master_params": 4 / shards,
            "optimizer_state": 8 / shards, "master_grads_during": 4 / shards if world > 1 else 0}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_bytes_per_parameter_follow_zero_formulas(world: int, tmp_path: Path) -> None:
    spawn.run(measure, world, str(tmp_path))
    results = json.loads((tmp_path / f"mem-{world}.json").read_text())
    for stage, r in results.items():
        per_param = {k: v / r["n"] for k, v in r["between"].items()}
        per_param["master_grads_during"] = r["during"]["master_grads"] / r["n"]
        want = expected(int(stage), world)
        for key, value in want.items():
            assert value == pytest.approx(per_param[key], rel=0.01, abs=0.01), (stage, key, per_param)
        assert per_param["master_grads"] == 0  # released after every step
        total = sum(want[k] for k in ("params", "grads", "master_params", "optimizer_state"))
        formula = {0: 16, 1: 4 + 12 / world, 2: 2 + 12 / world if world > 1 else 16,
                   3: 14 / world if world > 1 else 16}[int(stage)]
        assert total == pytest.approx(formula)
