"""Gradient compression for the data-parallel reduction (config `gradient_compression`).

fp16/bf16 need nothing here: they set the reducer's reduction dtype (engine.py).

topk (with error feedback, as in Deep Gradient Compression): for each bucket a rank adds its
fp32 residual to the gradient, keeps the k largest-magnitude entries of that sum and carries
the rest as the new residual, so `sent + residual == gradient + old residual` exactly and
nothing is lost, only delayed. k is the same on every rank (it depends only on the bucket size
and the step), so the (index, value) pairs travel in one fixed-size all_gather per bucket (the
int32 indices bit-cast to float32 and packed behind the values): gloo and NCCL both do that,
neither has a sparse all-reduce. Each rank then sums the received pairs that fall into the
part of the bucket it keeps: the whole bucket at stage 0, its ZeRO shard slice at stages 1/2.
The result is the same dense sum the reduce-scatter would have produced, so averaging,
clipping and the optimizer continue unchanged.

Residuals are in the units of the gradients the reducer sees (loss-scaled): the engine calls
`on_step` after every optimizer step to rescale them when the loss scale moves and to drop
them after an overflow (the sum that produced them held inf/NaN).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import comm

BucketKey = Tuple[int, int]  # (flat space index, bucket index)


class CommStats:
    """Bytes this rank contributes to gradient reductions: the last optimizer step and in total.

    `bytes_sent` counts the payload a rank puts into the collectives (top-k: indices and values;
    dense: the reduced buffer); `dense_bytes` what the same reductions carry uncompressed
    (communication_data_type, fp32 by default). Wire traffic depends on the algorithm: a ring
    all_gather sends (N-1) payloads per rank, a ring reduce-scatter (N-1)/N of the buffer.
    """

    def __init__(self) -> None:
        self._window = [0, 0]
        self.last = {"bytes_sent": 0, "dense_bytes": 0}
        self.total = {"bytes_sent": 0, "dense_bytes": 0}
        self.steps = 0

    def add(self, sent: int, dense: int) -> None:
        self._window[0] += sent
        self._window[1] += dense

    def end_step(self) -> None:
        sent, dense = self._window
        self.last = {"bytes_sent": sent, "dense_bytes": dense}
        self.total = {"bytes_sent": self.total["bytes_sent"] + sent,
                      "dense_bytes": self.total["dense_bytes"] + dense}
        self._window = [0, 0]
        self.steps += 1

    def summary(self) -> dict:
        sent, dense = self.last["bytes_sent"], self.last["dense_bytes"]
        return {"bytes_sent": sent, "dense_bytes": dense, "ratio": dense / sent if sent else 1.0,
                "total_bytes_sent": self.total["bytes_sent"],
                "total_dense_bytes": self.total["dense_bytes"], "steps": self.steps}


class TopK:
    """Top-k sparsification with error feedback and an exponential density warm-up."""

    def __init__(self, ratio: float, warmup_steps: int = 0, error_feedback: bool = True):
        self.ratio, self.warmup_steps, self.error_feedback = ratio, warmup_steps, error_feedback
        self.residuals: Dict[BucketKey, torch.Tensor] = {}
        self.step = 0  # optimizer steps seen (on_step), drives the warm-up

    def density(self) -> float:
        """1.0 at step 0, falling geometrically to `ratio` at `warmup_steps` and after."""
        if self.step >= self.warmup_steps:
            return self.ratio
        return self.ratio ** (self.step / self.warmup_steps)

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density() * numel)))

    def select(self, key: BucketKey, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, fp32 values) to send for one bucket; the remainder becomes the residual."""
        acc = grad.to(torch.float32, copy=True)  # never alias the flat gradient buffer
        residual = self.residuals.get(key)
        if residual is not None:
            acc.add_(residual)
        k = self.k_for(acc.numel())
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        values = acc[idx]
        if self.error_feedback:
            acc[idx] = 0.0  # what is sent leaves the residual; the rest waits for a later step
            self.residuals[key] = acc
        return idx.to(torch.int32), values

    def exchange(self, key: BucketKey, grad: torch.Tensor, lo: int, hi: int,
                 group: Optional[dist.ProcessGroup]) -> Tuple[int, Callable[[], torch.Tensor]]:
        """Start the all_gather of this rank's pairs for one bucket.

        Returns (payload bytes sent, finish): finish() waits and returns the fp32 sum over all
        ranks of the bucket's entries [lo, hi) (bucket-relative; this rank's part).
        """
        idx, values = self.select(key, grad)
        k = idx.numel()
        payload = torch.cat([values, idx.view(torch.float32)])
        world = dist.get_world_size(group)
        gathered = torch.empty(world * 2 * k, dtype=torch.float32, device=payload.device)
        work = comm.all_gather(gathered, payload, group=group, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            pairs = gathered.view(world, 2 * k)
            all_values = pairs[:, :k].reshape(-1)
            all_idx = pairs[:, k:].contiguous().view(torch.int32).reshape(-1).long()
            out = torch.zeros(hi - lo, dtype=torch.float32, device=gathered.device)
            if lo == 0 and hi == grad.numel():
                return out.index_add_(0, all_idx, all_values)
            mine = (all_idx >= lo) & (all_idx < hi)
            return out.index_add_(0, all_idx[mine] - lo, all_values[mine])
        return payload.numel() * payload.element_size(), finish

    def on_step(self, overflow: bool, scale_ratio: float) -> None:
        """After an optimizer step: advance the warm-up; keep residuals in the new loss scale."""
        self.step += 1
        if overflow:
            self.residuals.clear()
        elif scale_ratio != 1.0:
            for r in self.residuals.values():
                r.mul_(scale_ratio)

    def residual_norm(self) -> float:
        return math.sqrt(sum(float(r.double().square().sum()) for r in self.residuals.values()))
