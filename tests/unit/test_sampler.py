"""GlobalBatchSampler and ResumableLoader: exactly once across resizes, reproducible shuffles,
state round trips, and the batch rule for a changing world size. Ranks are simulated in one
process (tests/distributed/test_sampler_gloo.py runs real ones)."""
from __future__ import annotations

import json
from collections import Counter
from typing import Dict, List

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import hybrid_ray
from hybrid_ray.data import GlobalBatchSampler, ResumableLoader, build_dataloader, split_global_batch
from hybrid_ray.engine import Topology

CPU = torch.device("cpu")


class Indices(Dataset):
    """Item i is i: the loader's batches are then the sample indices themselves."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loaders(n: int, world: int, global_batch: int, micro: int, state: Dict[str, int] = None,
            seed: int = 7) -> List[ResumableLoader]:
    out = [build_dataloader(Indices(n), micro, Topology(r, world, CPU), seed=seed,
                            global_batch=global_batch) for r in range(world)]
    for loader in out:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    return out


def run_steps(ranks: List[ResumableLoader], steps: int, gas: int) -> List[int]:
    """Optimizer steps of all ranks in lockstep; returns every index read, in read order."""
    iters = [iter(r) for r in ranks]
    seen: List[int] = []
    for _ in range(steps * gas):
        batches = [next(it).tolist() for it in iters]
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat), "two ranks read the same sample in one micro-step"
        seen += flat
    states = [r.state_dict() for r in ranks]
    assert all(s == states[0] for s in states), "ranks disagree on the position"
    return seen


def test_every_sample_exactly_once_across_resizes_4_3_2_4():
    n, global_batch, micro = 120, 12, 3
    state, seen = None, []
    for world, steps in [(4, 3), (3, 2), (2, 3), (4, 2)]:  # 10 steps x 12 = one epoch of 120
        sizes = split_global_batch(global_batch, world, micro)
        assert sizes.micro_batch_size * sizes.gradient_accumulation_steps * world == global_batch
        ranks = loaders(n, world, global_batch, sizes.micro_batch_size, state)
        seen += run_steps(ranks, steps, sizes.gradient_accumulation_steps)
        state = ranks[0].state_dict()
    assert Counter(seen) == Counter(range(n))  # each of the 120 samples exactly once
    assert state["epoch"] == 1 and state["position"] == 0 and state["seed"] == 7
    # ... and in the one global order a single rank would have read.
    assert seen == GlobalBatchSampler(n, global_batch, 1, seed=7).order(0).tolist()


def test_split_global_batch_keeps_the_global_batch():
    assert split_global_batch(32, 2, 16) == hybrid_ray.config.BatchSizes(32, 16, 1)
    assert split_global_batch(32, 1, 16) == hybrid_ray.config.BatchSizes(32, 16, 2)
    assert split_global_batch(32, 4, 16) == hybrid_ray.config.BatchSizes(32, 8, 1)
    assert split_global_batch(12, 3, 3) == hybrid_ray.config.BatchSizes(12, 2, 2)  # 3 !| 4
    with pytest.raises(ValueError, match=r"train_batch_size 32 is not divisible by 3 data-parallel "
                                         r"ranks.*run on 1, 2, 4, 8, 16, 32 ranks"):
        split_global_batch(32, 3, 16)


def test_shuffle_is_seeded_per_epoch_and_world_size_independent():
    s = GlobalBatchSampler(50, 10, 5, seed=3)
    a0, a1 = s.order(0).tolist(), s.order(1).tolist()
    assert sorted(a0) == list(range(50)) and a0 != list(range(50)) and a0 != a1
    assert GlobalBatchSampler(50, 10, 1, seed=3).order(0).tolist() == a0  # another process
    assert GlobalBatchSampler(50, 10, 5, seed=4).order(0).tolist() != a0
    assert GlobalBatchSampler(50, 10, 5, shuffle=False).order(0).tolist() == list(range(50))
    one = run_steps(loaders(50, 1, 10, 5, seed=3), 5, 2)
    two = run_steps(loaders(50, 2, 10, 5, seed=3), 5, 1)
    assert one == two == a0


def test_epoch_drops_the_tail_and_reshuffles():
    ranks = loaders(25, 2, 10, 5)  # 2 global batches per epoch; 5 samples left over
    assert len(ranks[0]) == 2
    epoch0 = run_steps(ranks, 2, 1)
    assert ranks[0].state_dict()["epoch"] == 1
    epoch1 = run_steps(ranks, 2, 1)
    assert len(set(epoch0)) == 20 and len(set(epoch1)) == 20 and epoch0 != epoch1
    # A `for` over the loader ends with the epoch; the next `for` starts the next epoch.
    assert sum(1 for _ in ranks[0]) == 2 and ranks[0].epoch == 3


def test_state_dict_round_trip_continues_with_the_next_batch():
    a = loaders(40, 1, 8, 4)[0]
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    assert state == {"epoch": 0, "position": 12, "seed": 7, "num_samples": 40, "global_batch": 8}
    b = loaders(40, 1, 8, 4, state)[0]
    assert b.sampler.state_dict() == state  # the loader's state is its sampler's
    assert next(iter(b)).tolist() == next(it).tolist()


def test_prefetched_batches_are_not_counted():
    """Workers read ahead; only the batches handed to the loop count as consumed."""
    sampler = GlobalBatchSampler(40, 8, 4, seed=1)
    loader = ResumableLoader(Indices(40), sampler, num_workers=1)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["position"] == 4  # though the worker has fetched more
    del it


def test_load_rejects_other_data_and_unsplittable_positions():
    s = GlobalBatchSampler(40, 8, 4)
    with pytest.raises(ValueError, match="saved for a dataset of 41 samples, this one has 40"):
        s.load_state_dict({"epoch": 0, "position": 8, "seed": 0, "num_samples": 41})
    with pytest.raises(ValueError, match="position 6 of 40 samples per epoch cannot be split into "
                                         "micro-steps of 4 x 1 ranks = 4 samples"):
        s.load_state_dict({"epoch": 0, "position": 6, "seed": 0})
    with pytest.raises(ValueError, match=r"missing \['seed'\]"):
        s.load_state_dict({"epoch": 0, "position": 8})
    with pytest.raises(ValueError, match="not a multiple of micro_batch \\* world = 4 \\* 3 = 12"):
        GlobalBatchSampler(40, 8, 4, rank=0, world=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(5, 8, 4)


def test_initialize_returns_the_resumable_loader():
    model = torch.nn.Linear(4, 1)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "seed": 5,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = hybrid_ray.initialize(model, config=cfg, training_data=Indices(20))
    assert isinstance(loader, ResumableLoader) and engine.training_dataloader is loader
    assert loader.sampler.global_batch == 8 and loader.sampler.seed == 5
    assert len(loader) == 4  # 16 of the 20 samples per epoch, in micro-batches of 4
    assert np.array_equal(next(iter(loader)).numpy(), loader.sampler.order(0)[:4])
    engine.close()
