"""Each rank writes about 1/N of a checkpoint's bytes: parameters go to ranks by size (a
round-robin over sorted names gave one rank of the main job 75 times the other's bytes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybrid_ray.engine.checkpoint.state import owners
import torch

from hybrid_ray.lm.job import load_job
from hybrid_ray.lm.setup import build_model

REPO = Path(__file__).resolve().parents[2]


def loads(sizes: dict, world: int) -> list:
    out = owners(sizes, world)
    per_rank = [0] * world
    for name, rank in out.items():
        per_rank[rank] += sizes[name]
    return per_rank


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "jobs" / "configs").glob("*.json")))
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_jobs_models_spread_evenly(config, world) -> None:
    job = load_job(REPO / "jobs" / "configs" / config)
    with torch.device("meta"):  # shapes only: the 1.3B model needs no memory
        model = build_model(job, vocab_size=50257, seed=0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    per_rank = loads(sizes, world)
    total, largest = sum(sizes.values()), max(sizes.values())
    # greedy largest-first: no rank exceeds an even share by more than one tensor's worth
    assert max(per_rank) <= max(total / world * 1.10, largest), per_rank
    assert min(per_rank) >= total / world - largest, per_rank


def test_the_assignment_is_a_pure_function_of_names_and_sizes() -> None:
    sizes = {"b": 5, "a": 5, "c": 9, "d": 1}
    assert owners(sizes, 2) == owners(dict(reversed(list(sizes.items()))), 2) == \
        {"c": 0, "a": 1, "b": 1, "d": 0}
    assert owners(sizes, 1) == {n: 0 for n in sizes}
    assert owners({"x": 3}, 4) == {"x": 0}
