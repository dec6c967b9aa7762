"""Data loading for the engine: each data-parallel rank reads its own part of every batch."""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .engine.topology import Topology


def build_dataloader(dataset: Dataset, micro_batch_size: int, topo: Topology,
                     collate_fn: Optional[Callable] = None, seed: int = 0,
                     shuffle: bool = True) -> DataLoader:
    """A DataLoader of micro-batches for this rank: a seeded DistributedSampler split.

    drop_last keeps every rank at the same number of steps, so no rank waits forever in a
    collective at the end of an epoch.
    """
    sampler = DistributedSampler(dataset, num_replicas=topo.world_size, rank=topo.rank,
                                 shuffle=shuffle, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler,
                      collate_fn=collate_fn, drop_last=True)
