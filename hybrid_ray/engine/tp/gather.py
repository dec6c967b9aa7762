"""The whole tensors back from tensor-parallel shards (export, comparison with one process)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from .local import TensorParallelModel


def unshard(state: Dict[str, torch.Tensor], tpm: TensorParallelModel, group: dist.ProcessGroup,
            size: int, device: torch.device) -> Dict[str, torch.Tensor]:
    """`state` (this rank's shards, as named in the model) with every sharded entry replaced by
    the whole tensor. Collective over the tensor-parallel group: every rank of it calls this
    with the same names, in the same order."""
    out = dict(state)
    for name in sorted(state):
        placements = tpm.placements.get(name, ())
        dims = [p.dim for p in placements if p.is_shard()]
        if not dims:
            continue
        local = state[name].to(device).contiguous()  # NCCL gathers device tensors only
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local, group=group)
        pieces = [p.to(state[name].device) for p in pieces]
        dim, parts = dims[0], tpm.parts.get(name, 1)
        if parts == 1:
            out[name] = torch.cat(pieces, dim)
        else:  # each rank holds its share of every part: whole parts first, then side by side
            split = [p.view(parts, -1, *p.shape[1:]) for p in pieces]
            out[name] = torch.cat(split, 1).reshape(-1, *local.shape[1:])
    return out
