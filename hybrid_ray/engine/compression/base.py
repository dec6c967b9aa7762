"""What every gradient compressor shares: bucket keys, layouts, and error-feedback residuals.

Both compressors (topk.py, powersgd.py) implement the interface the reducer uses:
`exchange(key, grad, lo, hi, group, layout) -> (bytes sent, finish)`, `on_step`, `residuals`.

Residuals are in the units of the gradients the reducer sees (loss-scaled): the engine calls
`on_step` after every optimizer step to rescale them when the loss scale moves and to drop
them after an overflow (the sum that produced them held inf/NaN).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .stats import StepTimer

BucketKey = Tuple[int, int]  # (flat space index, bucket index)
Layout = Sequence[Tuple[int, torch.Size]]  # (bucket-relative offset, shape) of each parameter


class ErrorFeedback:
    """Per-bucket fp32 residuals kept in the loss scale's units; the base of both compressors."""

    def __init__(self, warmup_steps: int, error_feedback: bool):
        self.warmup_steps, self.error_feedback = warmup_steps, error_feedback
        self.residuals: Dict[BucketKey, torch.Tensor] = {}
        self.step = 0  # optimizer steps seen (on_step), drives the warm-up
        self.timer = StepTimer(torch.device("cpu"))  # the reducer hands in its own

    @property
    def warming(self) -> bool:
        """Still in the warm-up: the next reduction is dense, or denser than the setting asks."""
        return self.step < self.warmup_steps

    def residual_stores(self) -> Tuple[Dict[Any, torch.Tensor], ...]:
        """Every dict of residuals this compressor keeps (a subclass may keep more than one)."""
        return (self.residuals,)

    def on_step(self, overflow: bool, scale_ratio: float) -> None:
        """After an optimizer step: advance the warm-up; keep residuals in the new loss scale."""
        self.step += 1
        for store in self.residual_stores():
            if overflow:
                store.clear()
            elif scale_ratio != 1.0:
                for r in store.values():
                    r.mul_(scale_ratio)

    def with_residual(self, key: BucketKey, grad: torch.Tensor) -> torch.Tensor:
        """The bucket's gradient in fp32 plus the residual it carries (taken out of the store): a
        new tensor, never an alias of the flat gradient buffer."""
        acc = grad.to(torch.float32, copy=True)
        residual = self.residuals.pop(key, None)
        if residual is not None:
            acc.add_(residual)
        return acc

    def state_dict(self) -> Dict[str, Any]:
        """Host copies of what a recovery at the same size needs to go on bit for bit."""
        return {"step": self.step, "residuals": host_copies(self.residuals)}

    def load_state_dict(self, state: Dict[str, Any], device: torch.device) -> None:
        self.step = state["step"]
        self.residuals = {k: v.to(device) for k, v in state["residuals"].items()}

    def residual_norm(self) -> float:
        return math.sqrt(sum(float(r.double().square().sum()) for r in self.residuals.values()))


def dense_exchange(acc: torch.Tensor, lo: int, hi: int, group: Optional[dist.ProcessGroup],
                   timer: StepTimer) -> Tuple[int, Callable[[], torch.Tensor]]:
    """The whole bucket (residual included) all-reduced: a compressor's warm-up, or nothing to
    compress. Returns (bytes sent, finish -> the sum of [lo, hi))."""
    work = dist.all_reduce(acc, group=group, async_op=True)

    def finish() -> torch.Tensor:
        timer.wait(work)
        return acc[lo:hi]
    return acc.numel() * 4, finish


def host_copies(tensors: Dict[Any, torch.Tensor]) -> Dict[Any, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
