"""Flat parameter buffers split into buckets, each bucket split evenly across ranks.

Every parameter of one (optimizer group, storage dtype) pair becomes a view into one flat
buffer, so a bucket of gradients is reduced with one collective and no copies, and the fp32
master of a rank is one tensor the optimizer updates with one fused kernel.

Layout: parameters in reverse registration order (roughly the order backward produces their
gradients, as DDP does), packed greedily into buckets of at most `bucket_numel` elements; each
bucket is padded to a multiple of `num_shards` so reduce-scatter and all-gather work on it
directly. Rank r owns slice r of every bucket; its shard of the space is the concatenation of
those slices, in bucket order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .partition import param_shape

# Bucket starts (and shard boundaries) are aligned to this many elements so the large
# per-bucket kernels and collectives work on 16-byte aligned memory in every dtype we use.
_ALIGN = 8


@dataclass
class Bucket:
    """A contiguous range [start, start + numel) of the flat buffer, padded for sharding."""

    index: int
    start: int
    numel: int = 0  # padded size, a multiple of num_shards
    content: int = 0  # elements holding parameters; the rest is zero padding
    params: List[nn.Parameter] = field(default_factory=list, repr=False)
    offsets: List[int] = field(default_factory=list)  # absolute offset of each param in the flat buffer

    def shard_range(self, rank: int, num_shards: int) -> Tuple[int, int]:
        """Absolute [begin, end) of rank's slice of this bucket."""
        size = self.numel // num_shards
        return self.start + rank * size, self.start + (rank + 1) * size


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def plan_buckets(params: Sequence[nn.Parameter], bucket_numel: int, num_shards: int) -> List[Bucket]:
    """Greedy packing in the given order; a parameter larger than a bucket gets its own."""
    buckets: List[Bucket] = []
    cursor, current, used = 0, None, 0
    pad = _ALIGN * num_shards
    for p in params:
        n = param_shape(p).numel()
        if current is None or (used > 0 and used + n > bucket_numel):
            if current is not None:
                current.content, current.numel = used, _round_up(used, pad)
                cursor = current.start + current.numel
            current, used = Bucket(len(buckets), cursor), 0
            buckets.append(current)
        current.params.append(p)
        current.offsets.append(current.start + used)
        used += n  # contiguous within a bucket, so a bucket's gradients concatenate in one kernel
    if current is not None:
        current.content, current.numel = used, _round_up(max(used, 1), pad)
    return buckets


class FlatSpace:
    """One flat buffer of parameters (one dtype, one optimizer group) and its buckets.

    After construction every parameter's `.data` is a view into `self.flat`; the original
    storage is freed. `shard_numel` is this rank's share: the size of its fp32 master.
    whole=False (stage 3 over parameters built under zero.Init): no flat buffer is allocated
    and the parameters are left as they are; `partition.fill_local_shard` then builds the
    local shard, so the whole space never exists on one rank.
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device,
                 bucket_numel: int, num_shards: int, rank: int, group_index: int, whole: bool = True):
        self.dtype, self.device = dtype, device
        self.offloaded = False  # optimizer offload: this space's masters live on the host (partial.py)
        # With one shard (stage 0) every rank owns the whole space.
        self.num_shards, self.rank, self.group_index = num_shards, rank if num_shards > 1 else 0, group_index
        self.params = list(params)
        self.buckets = plan_buckets(self.params, bucket_numel, num_shards)
        self.numel = self.buckets[-1].start + self.buckets[-1].numel if self.buckets else 0
        self.flat = torch.zeros(self.numel if whole else 0, dtype=dtype, device=device)
        self.bucket_of: Dict[int, Bucket] = {}
        self.shapes: Dict[int, torch.Size] = {id(p): param_shape(p) for p in self.params}
        for bucket in self.buckets:
            for p, off in zip(bucket.params, bucket.offsets):
                self.bucket_of[id(p)] = bucket
                if whole:
                    view = self.flat[off:off + p.numel()].view(self.shapes[id(p)])
                    view.copy_(p.data)
                    p.data = view
        self.shard_numel = sum(b.numel // num_shards for b in self.buckets)
        # Stage 3 only: this rank's slices, the sole persistent copy of the parameters; the full
        # `flat` storage then exists only while the unit is gathered.
        self.local_shard: Optional[torch.Tensor] = None

    def shard_slices(self) -> List[Tuple[Bucket, int, int, int]]:
        """(bucket, begin in flat, end in flat, begin in the shard) for this rank's slices."""
        out, cursor = [], 0
        for b in self.buckets:
            lo, hi = b.shard_range(self.rank, self.num_shards)
            out.append((b, lo, hi, cursor))
            cursor += hi - lo
        return out

    def gather_shard(self, source: torch.Tensor) -> torch.Tensor:
        """This rank's slices of a flat-sized tensor, concatenated (a copy)."""
        parts = [source[lo:hi] for _, lo, hi, _ in self.shard_slices()]
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    def views_of(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Views of a flat-sized buffer shaped like each parameter (for .grad, or stage 3's gather)."""
        out = []
        for bucket in self.buckets:
            for p, off in zip(bucket.params, bucket.offsets):
                shape = self.shapes[id(p)]
                out.append(flat[off:off + shape.numel()].view(shape))
        return out

    def param_offsets(self) -> List[Tuple[nn.Parameter, int]]:
        return [(p, off) for b in self.buckets for p, off in zip(b.params, b.offsets)]

    def ordered_params(self) -> List[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]
