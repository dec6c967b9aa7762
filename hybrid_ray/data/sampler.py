"""A distributed batch sampler keyed by the global sample index, resumable at any world size.

The whole job reads one global stream of sample indices per epoch: a permutation of
range(num_samples) computed from (seed, epoch), never stored. A position p counts the samples of
the current epoch already consumed by all ranks together. Every micro-step consumes the next
micro_batch * world positions: rank r takes the r-th run of micro_batch of them. An optimizer step
(gradient_accumulation_steps micro-steps) therefore consumes exactly one global batch, and what
has been consumed is always the prefix [0, p) of the epoch's order, whichever ranks consumed it.

That makes resuming world-size independent: the state is only {epoch, position, seed}, and a
job restarted on another number of ranks continues from position p, so over an epoch with any
sequence of resizes every sample is read exactly once (tests/unit/test_sampler.py).

Each epoch uses the largest multiple of the global batch that fits in the dataset; the few
samples left over are a different random set every epoch.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import numpy as np
from torch.utils.data import Sampler

from hybrid_ray.config.schema import BatchSizes


def split_global_batch(global_batch: int, world: int, micro_batch: int) -> BatchSizes:
    """The rule for a world size that changes: the global batch stays constant.

    The optimisation is then the same whatever the number of ranks (same samples per step, same
    learning-rate schedule). Each rank takes global_batch / world samples per step, in micro-batches
    of the configured size when it divides that share, else of the largest size below it that does
    (so a micro-batch never needs more memory than configured); the accumulation steps make up the
    rest. A world size that does not divide the global batch cannot keep it: that is an error that
    lists the world sizes that can.
    """
    if global_batch < 1 or world < 1 or micro_batch < 1:
        raise ValueError(f"global batch {global_batch}, world size {world}, micro-batch "
                         f"{micro_batch}: all must be >= 1")
    if global_batch % world:
        fits = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        raise ValueError(f"train_batch_size {global_batch} is not divisible by {world} data-parallel "
                         f"ranks: the global batch stays constant when the world size changes, so "
                         f"run on {', '.join(map(str, fits))} ranks or choose a train_batch_size "
                         f"divisible by {world}")
    share = global_batch // world
    micro = max(m for m in range(1, min(micro_batch, share) + 1) if share % m == 0)
    return BatchSizes(global_batch, micro, share // micro)


class GlobalBatchSampler(Sampler[List[int]]):
    """Yields this rank's micro-batches (lists of global sample indices) from the saved position.

    Iterating does not move the position: whoever delivers the batches calls `advance()` once per
    micro-batch actually handed to the training loop (ResumableLoader does), so batches prefetched
    by DataLoader workers but never used are not counted as consumed.
    """

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int, rank: int = 0,
                 world: int = 1, seed: int = 0, shuffle: bool = True):
        if micro_batch < 1 or world < 1 or not 0 <= rank < world:
            raise ValueError(f"micro_batch {micro_batch}, rank {rank}, world {world}: need "
                             "micro_batch >= 1 and 0 <= rank < world")
        step = micro_batch * world
        if global_batch < step or global_batch % step:
            raise ValueError(f"global batch {global_batch} is not a multiple of micro_batch * world "
                             f"= {micro_batch} * {world} = {step} (see split_global_batch)")
        if num_samples < global_batch:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch "
                             f"({global_batch}): use more data or a smaller train_batch_size")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.micro_batch, self.rank, self.world = micro_batch, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    @property
    def samples_per_epoch(self) -> int:
        """Whole global batches only: every optimizer step sees a full batch."""
        return self.num_samples // self.global_batch * self.global_batch

    @property
    def samples_per_micro_step(self) -> int:
        return self.micro_batch * self.world

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order: the same on every rank, every run, every world size."""
        if self._order_epoch != epoch:
            if self.shuffle:
                # numpy's Generator: a documented, stable stream for a given seed sequence. 4 bytes
                # per sample (uint32) while the dataset has fewer than 2**32 samples.
                dtype = np.uint32 if self.num_samples < 2**32 else np.int64
                order = np.arange(self.num_samples, dtype=dtype)
                np.random.Generator(np.random.PCG64([self.seed, epoch])).shuffle(order)
            else:
                order = np.arange(self.num_samples, dtype=np.int64)
            self._order, self._order_epoch = order, epoch
        return self._order

    def __iter__(self) -> Iterator[List[int]]:
        epoch, start = self.epoch, self.position
        order = self.order(epoch)
        lo = self.rank * self.micro_batch
        for p in range(start, self.samples_per_epoch, self.samples_per_micro_step):
            yield order[p + lo:p + lo + self.micro_batch].tolist()

    def __len__(self) -> int:
        """Micro-batches per epoch for this rank (a whole epoch, whatever the position)."""
        return self.samples_per_epoch // self.samples_per_micro_step

    def advance(self, micro_steps: int = 1) -> None:
        """Count micro_steps micro-batches as consumed by every rank; roll over to the next epoch."""
        self.position += micro_steps * self.samples_per_micro_step
        if self.position >= self.samples_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's call: start `epoch` from its beginning (no-op for the current one)."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> Dict[str, int]:
        """Global, identical on every rank: where the job is in its sample stream."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch": self.global_batch}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue from a saved position, possibly saved by a different number of ranks."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state: missing {sorted(missing)}; got keys {sorted(state)}")
        saved_n = state.get("num_samples", self.num_samples)
        if saved_n != self.num_samples:
            raise ValueError(f"sampler state: saved for a dataset of {saved_n} samples, this one "
                             f"has {self.num_samples}: the data changed since the checkpoint")
        epoch, position = int(state["epoch"]), int(state["position"])
        remaining = self.samples_per_epoch - position
        if position < 0 or remaining < 0 or remaining % self.samples_per_micro_step:
            raise ValueError(
                f"sampler state: position {position} of {self.samples_per_epoch} samples per epoch "
                f"cannot be split into micro-steps of {self.micro_batch} x {self.world} ranks = "
                f"{self.samples_per_micro_step} samples (save checkpoints at optimizer steps and "
                f"keep the global batch: see split_global_batch)")
        if remaining == 0:  # saved after the epoch's last batch with a larger global batch
            epoch, position = epoch + 1, 0
        # The order is a function of the seed: a resumed run must keep the one it started with.
        self.seed, self.epoch, self.position = int(state["seed"]), epoch, position
        self._order_epoch = -1
