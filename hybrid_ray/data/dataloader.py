"""The data loader `initialize(training_data=...)` returns: micro-batches for this rank, resumable.

A thin wrapper around torch's DataLoader (which still does the reading, collation, worker
processes and pinning) that owns a GlobalBatchSampler and counts the micro-batches it hands to
the training loop. Its state_dict() is the sampler's: the engine's checkpoints save it (duck
typing on `engine.training_dataloader`), so a resumed job, at any world size, continues from the
same global sample index.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from .sampler import GlobalBatchSampler

if TYPE_CHECKING:  # the data layer sits below the engine: only its rank, size and device are read
    from hybrid_ray.engine import Topology


class ResumableLoader:
    """Iterates this rank's micro-batches from the saved position to the end of the epoch.

    `for batch in loader` runs to the end of the current epoch; the next `for` starts the next
    epoch (or continues the current one after load_state_dict). Load the state before iterating:
    an iterator already started keeps the position it started from.
    """

    def __init__(self, dataset: Dataset, sampler: GlobalBatchSampler,
                 collate_fn: Optional[Callable] = None, num_workers: int = 0,
                 pin_memory: bool = False):
        self.dataset, self.sampler = dataset, sampler
        self.batch_size = sampler.micro_batch
        self._loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn,
                                  num_workers=num_workers, pin_memory=pin_memory,
                                  persistent_workers=num_workers > 0)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            # Counted before the loop sees it: a checkpoint taken after this batch's step must
            # resume after it. A batch prefetched by a worker but never delivered is not counted.
            self.sampler.advance()
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> Dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


def build_dataloader(dataset: Dataset, micro_batch_size: int, topo: Topology,
                     collate_fn: Optional[Callable] = None, seed: int = 0, shuffle: bool = True,
                     global_batch: Optional[int] = None, num_workers: int = 0) -> ResumableLoader:
    """This rank's loader for any map-style dataset (one with __len__ and __getitem__).

    global_batch (samples per optimizer step over all ranks; default one micro-batch per rank)
    sets the epoch length: whole global batches only, so every optimizer step is full and every
    rank runs the same number of steps (no rank left waiting in a collective at an epoch's end).
    """
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"training_data: {type(dataset).__name__} has no __len__; the resumable "
                        "sampler needs a map-style dataset (__len__ and __getitem__)")
    sampler = GlobalBatchSampler(len(dataset), global_batch or micro_batch_size * topo.world_size,
                                 micro_batch_size, topo.rank, topo.world_size, seed, shuffle)
    pin = topo.device.type == "cuda" and torch.cuda.is_available()
    return ResumableLoader(dataset, sampler, collate_fn, num_workers, pin)
