"""Top-k sparsification with error feedback (Deep Gradient Compression), for the reduction.

For each bucket a rank adds its fp32 residual to the gradient, keeps the k largest-magnitude
entries of that sum and carries the rest as the new residual, so `sent + residual == gradient +
old residual` (exactly with fp32 values; to one fp32 rounding with bf16 or int8 ones) and nothing
is lost, only delayed. k is the same on every rank (it depends
only on the bucket size and the step), so the (index, value) pairs travel in one fixed-size
all_gather per bucket, packed as bytes by codec.py (fp32, bf16 or int8 values; int32 or 16-bit
block-relative indices): gloo and NCCL both do that, neither has a sparse all-reduce. Each rank
then sums the received pairs that fall into the part of the bucket it keeps: the whole bucket at
stage 0, its ZeRO shard slice at stages 1-3. The result is the same dense sum the reduce-scatter
would have produced, so averaging, clipping and the optimizer continue unchanged.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .base import BucketKey, ErrorFeedback, Layout
from .codec import PairCodec


class TopK(ErrorFeedback):
    """Top-k sparsification with error feedback and an exponential density warm-up."""

    def __init__(self, ratio: float, warmup_steps: int = 0, error_feedback: bool = True,
                 codec: PairCodec = PairCodec()):
        super().__init__(warmup_steps, error_feedback)
        self.ratio, self.codec = ratio, codec

    def density(self) -> float:
        """1.0 at step 0, falling geometrically to `ratio` at `warmup_steps` and after."""
        if self.step >= self.warmup_steps:
            return self.ratio
        return self.ratio ** (self.step / self.warmup_steps)

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density() * numel)))

    def select(self, key: BucketKey, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(int32 indices, the values as receivers decode them, payload bytes) for one bucket;
        the remainder, rounding included, becomes the residual."""
        acc = self.with_residual(key, grad)
        k = self.k_for(acc.numel())
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        if self.codec.sorted:
            idx = idx.sort().values
        payload, sent = self.codec.encode(idx, acc[idx], acc.numel())
        if self.error_feedback:
            # What is sent leaves the residual (all of it in fp32: exactly zero stays); the rest,
            # and what the values' rounding lost, waits for a later step.
            acc[idx] = acc[idx] - sent
            self.residuals[key] = acc
        return idx.to(torch.int32), sent, payload

    def exchange(self, key: BucketKey, grad: torch.Tensor, lo: int, hi: int,
                 group: Optional[dist.ProcessGroup], layout: Optional[Layout] = None
                 ) -> Tuple[int, Callable[[], torch.Tensor]]:
        """Start the all_gather of this rank's pairs for one bucket (`layout` is not needed).

        Returns (payload bytes sent, finish): finish() waits and returns the fp32 sum over all
        ranks of the bucket's entries [lo, hi) (bucket-relative; this rank's part).
        """
        numel = grad.numel()
        with self.timer.span("compress"):
            idx, _, payload = self.select(key, grad)
            k = idx.numel()
        world = dist.get_world_size(group)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        work = comm.all_gather(gathered, payload, group=group, async_op=True)

        def finish() -> torch.Tensor:
            self.timer.wait(work)
            pairs = [self.codec.decode(row, k, numel) for row in gathered.view(world, -1)]
            all_idx = torch.cat([i for i, _ in pairs])
            all_values = torch.cat([v for _, v in pairs])
            out = torch.zeros(hi - lo, dtype=torch.float32, device=gathered.device)
            if lo == 0 and hi == numel:
                return out.index_add_(0, all_idx, all_values)
            mine = (all_idx >= lo) & (all_idx < hi)
            return out.index_add_(0, all_idx[mine] - lo, all_values[mine])
        return payload.numel(), finish
