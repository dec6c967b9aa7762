"""The timed loop every throughput benchmark under jobs/ shares."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def timed_steps(step: Callable, x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int,
                cuda: bool) -> tuple:
    """Seconds per step over `steps` after `warmup` untimed ones (peak memory counted from the
    timed ones), and the last step's loss."""
    for _ in range(warmup):
        step(x, y)
    sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(x, y)
    sync(cuda)
    return (time.perf_counter() - t0) / steps, loss


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
