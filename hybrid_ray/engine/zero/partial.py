"""Partial optimizer offload (ZeRO-Offload++'s Twin-Flow): a share of the parameters keeps its
fp32 masters, gradients and optimizer state on the host and steps on the CPU; the rest stays
and steps on the device.

The split is by flat space, so each space's master has one device, as without offload: at
stages 1-2 each (group, dtype) list of parameters is cut in two, the first `ratio` of its
elements in module order going to a host space; at stage 3 (a space per module unit) whole
units go to the host, in module order, until `ratio` of the elements are there. One torch
optimizer steps both kinds of masters: its fused and foreach kernels group tensors by device.

`ratio: "auto"` keeps on the device what fits in half of the device memory free once the
model is on it (the other half is left to activations and the allocator), at 16 bytes per
element kept (fp32 master, two Adam moments, the fp32 master gradient); a CPU engine offloads
all (host and device memory are the same there).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn as nn

from .flat import FlatSpace

DEVICE_BYTES_PER_ELEMENT = 16  # kept on the device instead: master 4, Adam moments 8, master grad 4
AUTO_SHARE_OF_FREE = 0.5


def resolve_ratio(ratio: object, device: torch.device, numel: int) -> float:
    """The configured ratio as a fraction ("auto": from the device's free memory now)."""
    if ratio != "auto":
        return float(ratio)
    if device.type != "cuda" or numel == 0:
        return 1.0
    free, _ = torch.cuda.mem_get_info(device)
    kept = min(numel, int(free * AUTO_SHARE_OF_FREE) // DEVICE_BYTES_PER_ELEMENT)
    return 1.0 - kept / numel


def split(params: Sequence[nn.Parameter], ratio: float) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """(host share, device share) of `params` in their order: the host share is the shortest
    prefix holding at least `ratio` of the elements (1.0: all; 0.0: none)."""
    total = sum(p.numel() for p in params)
    goal, host, seen = ratio * total, [], 0
    for p in params:
        if seen >= goal and ratio < 1.0:
            break
        host.append(p)
        seen += p.numel()
    return host, list(params[len(host):])


def mark_units(spaces: Sequence[FlatSpace], ratio: float) -> None:
    """Stage 3: offload whole spaces (module units, in module order) up to `ratio` of the elements."""
    total = sum(s.numel for s in spaces)
    seen = 0
    for space in spaces:
        space.offloaded = ratio >= 1.0 or seen < ratio * total
        seen += space.numel if space.offloaded else 0


def offloaded_numel(spaces: Sequence[FlatSpace]) -> Tuple[int, int]:
    """(elements in host spaces, all elements)."""
    return sum(s.numel for s in spaces if s.offloaded), sum(s.numel for s in spaces)
