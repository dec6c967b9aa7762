"""Whole tensors from tensor-parallel shards and back: one rule for the engine's export
(consolidated_state_dict), checkpoints (checkpoint/split.py) and the fused column split.

A shard along `dim` is one of `size` equal chunks; a weight of `parts` side-by-side parts (a
fused q, k, v) is split part by part, each rank holding its chunk of every part."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # local.py's plan styles cut with this module's cut()
    from .local import TensorParallelModel


def cut(whole: torch.Tensor, dim: int, parts: int, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of a whole tensor (no communication)."""
    if parts > 1:
        split = whole.view(parts, -1, *whole.shape[1:]).chunk(size, dim=1)[rank]
        return split.reshape(-1, *whole.shape[1:]).contiguous()
    return whole.chunk(size, dim)[rank].contiguous()


def join(pieces: List[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (the inverse of cut)."""
    if parts > 1:
        whole = torch.cat([p.view(parts, -1, *p.shape[1:]) for p in pieces], 1)
        return whole.reshape(-1, *pieces[0].shape[1:])
    return torch.cat(pieces, dim)


def gather_whole(local: torch.Tensor, dim: int, parts: int, group: dist.ProcessGroup, size: int,
                 device: torch.device) -> torch.Tensor:
    """join() of every rank's `local`, on local's device (collective over the group)."""
    piece = local.to(device).contiguous()  # NCCL gathers device tensors only
    pieces = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(pieces, piece, group=group)
    return join(pieces, dim, parts).to(local.device)


def unshard(state: Dict[str, torch.Tensor], tpm: "TensorParallelModel", group: dist.ProcessGroup,
            size: int, device: torch.device) -> Dict[str, torch.Tensor]:
    """`state` (this rank's shards, as named in the model) with every sharded entry replaced by
    the whole tensor. Collective over the tensor-parallel group: every rank of it calls this
    with the same names, in the same order."""
    out = dict(state)
    for name in sorted(state):
        dims = [p.dim for p in tpm.placements.get(name, ()) if p.is_shard()]
        if dims:
            out[name] = gather_whole(state[name], dims[0], tpm.parts.get(name, 1), group, size, device)
    return out
