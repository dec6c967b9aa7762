"""The resumable sampler in real processes: 2 gloo ranks read part of an epoch, 3 ranks finish it
from the saved state; every sample is read exactly once."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from hybrid_ray.data import build_dataloader, split_global_batch
from hybrid_ray.engine import Topology
from tests.distributed import spawn
from tests.unit.test_sampler import Indices

pytestmark = [pytest.mark.dist, pytest.mark.slow]
N, GLOBAL_BATCH, MICRO = 60, 6, 3


def read_steps(rank: int, world: int, steps: int, state_file: str, out_file: str) -> None:
    sizes = split_global_batch(GLOBAL_BATCH, world, MICRO)
    loader = build_dataloader(Indices(N), sizes.micro_batch_size, Topology.from_environment(),
                              seed=11, global_batch=GLOBAL_BATCH)
    if Path(state_file).exists():
        loader.load_state_dict(json.loads(Path(state_file).read_text()))
    it = iter(loader)
    mine = [i for _ in range(steps * sizes.gradient_accumulation_steps) for i in next(it).tolist()]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        previous = json.loads(Path(out_file).read_text()) if Path(out_file).exists() else []
        Path(out_file).write_text(json.dumps(previous + [i for g in gathered for i in g]))
        Path(state_file).write_text(json.dumps(loader.state_dict()))


def test_two_then_three_ranks_read_each_sample_once(tmp_path):
    state, out = str(tmp_path / "state.json"), str(tmp_path / "seen.json")
    spawn.run(read_steps, 2, 4, state, out, timeout_s=60)  # 4 steps x 6 = 24 samples
    assert json.loads(Path(state).read_text())["position"] == 24
    spawn.run(read_steps, 3, 6, state, out, timeout_s=60)  # the remaining 36
    assert Counter(json.loads(Path(out).read_text())) == Counter(range(N))
    assert json.loads(Path(state).read_text()) == {"epoch": 1, "position": 0, "seed": 11,
                                                   "num_samples": N, "global_batch": GLOBAL_BATCH}
