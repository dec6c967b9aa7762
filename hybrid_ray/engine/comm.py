"""Collectives under the names of the installed torch.

torch 2.13 renamed the single-tensor collectives (`reduce_scatter_single`,
`all_gather_single`) and warns on the old names; the GPU machines run torch 2.11, which only has
the old ones. One place picks whichever exists.

`probe_bandwidth` measures a group's all-reduce bandwidth, for deciding on compression.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def probe_bandwidth(group: Optional[dist.ProcessGroup] = None, nbytes: int = 32 << 20,
                    repeats: int = 5) -> float:
    """Measured all-reduce bus bandwidth of `group` in bytes/s. Collective: every rank calls it.

    Times `repeats` all-reduces of an fp32 buffer of `nbytes` on the group's device (the
    current CUDA device for NCCL, else the CPU) after one untimed warm-up, and returns the
    ring-algorithm bus bandwidth 2(n-1)/n * nbytes / t for the mean time t per all-reduce,
    with t the slowest rank's (one more small all-reduce), so every rank returns the same
    number: what the driver weighs compression against. One rank: math.inf (no link).
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world <= 1:
        return math.inf
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)  # warm-up: connection setup, allocator, first-call costs
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buf, group=group)
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / max(1, repeats)], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return 2 * (world - 1) / world * buf.numel() * 4 / float(elapsed.item())
