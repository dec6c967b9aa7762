"""Parameters that exist only as per-rank shards before the engine is built (zero.Init).

A model constructed under `hybrid_ray.zero.Init` never holds a whole parameter for long: each
parameter keeps only this rank's slice of its flattened values (`Partition.shard`, padded so
every rank's slice has one size) and its `.data` is an empty tensor of the parameter's dtype,
as DeepSpeed does. The DeepSpeed attributes scripts read are set on it: `ds_shape`, `ds_numel`,
`ds_tensor` (the shard) and `ds_status`.

The engine consumes these shards at stage 3 (`fill_local_shard`: the stage-3 layout is cut
from one whole parameter at a time, so the peak is one parameter, never the model); wherever a
parameter must be whole (stages 0-2, frozen or persistent parameters) it is gathered whole
(`unpartition`). Rank 0 of the partition's group is the source of truth, as the engine's own
broadcast of rank 0's weights is for a model built normally.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Optional, Set

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm

PART_ATTR = "_hybrid_ray_partition"


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for whether a partitioned parameter is whole right now."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@dataclass
class Partition:
    """This rank's slice of one parameter, and the group its slices are spread over."""

    shape: torch.Size
    shard: torch.Tensor  # shard_numel elements: flat[rank*shard_numel : (rank+1)*shard_numel], zero padded
    rank: int
    world: int
    group: Optional[dist.ProcessGroup]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    def full(self) -> torch.Tensor:
        """The whole parameter, from every rank's shard (collective: the group calls it)."""
        out = torch.empty(self.shard_numel * self.world, dtype=self.shard.dtype, device=self.shard.device)
        comm.all_gather(out, self.shard, group=self.group)
        return out[:self.numel].view(self.shape)

    def set_from(self, full: torch.Tensor, src: int = 0, dtype: Optional[torch.dtype] = None) -> None:
        """Take this rank's slice of `full` as the group's rank `src` holds it (collective).

        A scatter, not a broadcast: each rank receives only its slice. Every rank passes a
        tensor of the parameter's shape; only `src`'s values count. dtype: of the new shard
        (default: unchanged).
        """
        self.shape = torch.Size(full.shape)
        n, size = full.numel(), -(-full.numel() // self.world)
        shard = torch.empty(size, dtype=dtype or self.shard.dtype, device=self.shard.device)
        if self.world == 1:
            shard.copy_(full.reshape(-1))
        else:
            chunks = None
            if self.rank == src:
                flat = full.detach().reshape(-1).to(shard.device, shard.dtype)
                flat = torch.cat([flat, flat.new_zeros(size * self.world - n)]) if n % self.world else flat
                chunks = [c.contiguous() for c in flat.split(size)]
            dist.scatter(shard, chunks, src=dist.get_global_rank(self.group or dist.group.WORLD, src),
                         group=self.group)
        self.shard = shard


def partition_of(p: torch.Tensor) -> Optional[Partition]:
    return getattr(p, PART_ATTR, None)


def is_partitioned(p: torch.Tensor) -> bool:
    return partition_of(p) is not None


def param_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's true shape, also while only its shard exists."""
    part = partition_of(p)
    return part.shape if part is not None else p.shape


def partition(p: nn.Parameter, group: Optional[dist.ProcessGroup], device: torch.device,
              dtype: Optional[torch.dtype] = None) -> Partition:
    """Keep only this rank's slice of `p` (rank 0's values) and empty its `.data` (collective)."""
    world = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    dtype = dtype or p.dtype
    part = Partition(p.shape, torch.empty(0, dtype=dtype, device=device), rank, world, group)
    part.set_from(p.data)
    setattr(p, PART_ATTR, part)
    release(p)
    return part


def release(p: nn.Parameter) -> None:
    """Drop the whole values; only the shard remains (DeepSpeed's `partition()` of a gathered param)."""
    part = partition_of(p)
    p.data = torch.empty(0, dtype=part.shard.dtype, device=p.device)
    _mark(p, part, ZeroParamStatus.NOT_AVAILABLE)


def gather(p: nn.Parameter) -> torch.Tensor:
    """Point `p.data` at its whole values (collective); `release` undoes it."""
    part = partition_of(p)
    p.data = part.full()
    _mark(p, part, ZeroParamStatus.AVAILABLE)
    return p.data


def _mark(p: nn.Parameter, part: Partition, status: ZeroParamStatus) -> None:
    p.ds_shape, p.ds_numel, p.ds_tensor, p.ds_status = part.shape, part.numel, part.shard, status


def unpartition(p: nn.Parameter) -> None:
    """Make `p` an ordinary whole parameter again, in the dtype the engine gave it (collective)."""
    dtype = p.dtype  # the precision policy may have re-cast the empty data
    p.data = partition_of(p).full().to(dtype)
    delattr(p, PART_ATTR)
    for name in ("ds_shape", "ds_numel", "ds_tensor", "ds_status"):
        if hasattr(p, name):
            delattr(p, name)


def unpartition_all(model: nn.Module, keep: Set[int]) -> None:
    """Gather whole every partitioned parameter of `model` whose id is not in `keep`, in
    registration order (the same on every rank: each gather is collective)."""
    for p in _unique(model.parameters()):
        if is_partitioned(p) and id(p) not in keep:
            unpartition(p)


def _unique(params: Iterable[nn.Parameter]):
    seen: Set[int] = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def fill_local_shard(space, group: Optional[dist.ProcessGroup]) -> None:
    """Build a stage-3 space's local shard (its rank's slice of every bucket) from the
    parameters' partitions, one parameter made whole at a time, and consume the partitions.

    `space` (a FlatSpace built with whole=False) has no flat buffer: this is the only time
    the model's values pass through whole, and never more than one parameter at once. A
    parameter that is whole already (assigned to the model outside Init) is taken from rank 0,
    as the engine's broadcast does for a model built normally.
    """
    shard = torch.zeros(space.shard_numel, dtype=space.dtype, device=space.device)
    slices = space.shard_slices()
    for p, off in space.param_offsets():
        n = space.shapes[id(p)].numel()
        if is_partitioned(p):
            whole = partition_of(p).full().reshape(-1)
            delattr(p, PART_ATTR)
            del p.ds_tensor  # the Init shard's last reference: freed as we go
        else:
            whole = p.data.detach().reshape(-1).to(space.device)
            if space.num_shards > 1:
                dist.broadcast(whole, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        for _, lo, hi, at in slices:
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                shard[at + a - lo:at + b - lo].copy_(whole[a - off:b - off])
        p.data = torch.empty(0, dtype=space.dtype, device=space.device)
    space.local_shard = shard
