"""Rebuilding an engine's state from the replicas the survivors hold, with no disk read.

Every rank of the new group sends what its keeper holds (keeper.summary) to the others; all of
them compute the same plan (the newest version held for every rank of the old group); then, one
old shard at a time, its holder broadcasts it over the new group's gloo group and every rank
places it in the old flat layout. Whole parameters cut from that layout by name are exactly
what a checkpoint holds, so the state goes in through the checkpoint's own `apply`, which
re-shards it for the new group's size and stage. RNG states are restored when the group has
the old size (new rank r takes old rank r's), as for checkpoints.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..checkpoint import state as cstate
from ..checkpoint.state import TrainState
from . import snapshot as snap
from .keeper import Keeper, Plan, plan

Tensors = Dict[str, torch.Tensor]


def gather_summaries(keeper: Keeper, group: Optional[dist.ProcessGroup], world: int) -> List[dict]:
    mine = keeper.summary()
    if world == 1:
        return [mine]
    out: List[Optional[dict]] = [None] * world
    dist.all_gather_object(out, mine, group=group)
    return out


def _broadcast_bytes(data: Optional[bytes], src: int, group: Optional[dist.ProcessGroup], me: int) -> bytes:
    if group is None:
        return data
    size = torch.tensor([len(data) if me == src else 0], dtype=torch.int64)
    dist.broadcast(size, group_src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if me == src else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, group_src=src, group=group)
    return buf.numpy().tobytes()


def _shard_slices(layout: dict, rank: int) -> List[Tuple[int, int, int]]:
    """(begin in flat, end in flat, begin in the shard) of old rank `rank`'s slices."""
    out, cursor, shards = [], 0, layout["num_shards"]
    for start, numel in layout["buckets"]:
        size = numel // shards
        lo = start + (rank if shards > 1 else 0) * size
        out.append((lo, lo + size, cursor))
        cursor += size
    return out


def _whole(p: Plan, keeper: Keeper, group, me: int, layouts: List[dict], keys: List[List[str]],
           dtypes: List[List[torch.dtype]]) -> Tensors:
    """Whole parameters by name ("<name>/<key>"), from every old rank's shard."""
    saved: Tensors = {}
    for i, space in enumerate(layouts):
        shard_numel = sum(numel // space["num_shards"] for _, numel in space["buckets"])
        for key, dtype in zip(keys[i], dtypes[i]):
            full = torch.zeros(space["numel"], dtype=dtype)
            owners = range(p.world) if space["num_shards"] > 1 else [0]
            for old in owners:
                src, where = p.sources[old]
                # A replay-mode rank's own shard is the live tensor: on its device, maybe.
                t = keeper.get(where, p.step).tensors[i][key].detach().cpu() if src == me else \
                    torch.empty(shard_numel, dtype=dtype)
                if group is not None:
                    dist.broadcast(t, group_src=src, group=group)
                for lo, hi, off in _shard_slices(space, old):
                    full[lo:hi] = t[off:off + hi - lo]
            for name, off, shape in space["params"]:
                n = torch.Size(shape).numel()
                saved[f"{name}/{key}"] = full[off:off + n].view(shape)
    return saved


def _each_holds_its_own(p: Plan, world: int, layout: List[dict], ts: TrainState) -> bool:
    """Whether every new rank r holds old rank r's shard, in this engine's layout (a lone
    worker's spare, a restart at the same size): then each rank loads its own, no collective.
    The same answer on every rank (the plan and the layouts are)."""
    return p.world == world and all(p.sources[r][0] == r for r in range(world)) and layout == snap.layout(ts)


def _keys_and_dtypes(p: Plan, keeper: Keeper, group, me: int) -> Tuple[List[List[str]], List[List[torch.dtype]]]:
    """Per space, the state keys and their dtypes, as the holder of old rank 0's shard has them."""
    src0, where0 = p.sources[0]
    first = keeper.get(where0, p.step) if me == src0 else None
    box = [[[(k, t.dtype) for k, t in ts_.items()] for ts_ in first.tensors] if first else None]
    if group is not None:
        dist.broadcast_object_list(box, group_src=src0, group=group)
    return [[k for k, _ in s] for s in box[0]], [[d for _, d in s] for s in box[0]]


def recover(ts: TrainState, keeper: Keeper, group: Optional[dist.ProcessGroup], run: Optional[str]
            ) -> Tuple[Optional[int], str, Optional[snap.SmallState]]:
    """Load the newest complete version of the replicas into `ts`: (its step, "ok", the small
    state of the old rank this rank continues, or None at another size), or (None, why not,
    None) with `ts` untouched. Collective over the new group."""
    world, me = ts.topology.world_size, ts.topology.rank
    p, why = plan(gather_summaries(keeper, group, world), run)
    if p is None:
        return None, why, None
    srcm, wherem = p.meta_source  # the step's counters and layout: the same for every old rank
    small = snap.parse_small(_broadcast_bytes(keeper.get(wherem, p.step).small if me == srcm else None,
                                              srcm, group, me))
    saved, shards = {}, None
    if _each_holds_its_own(p, world, small.layout, ts):  # no resharding: straight into place
        shards = keeper.get(p.sources[me][1], p.step).tensors
    else:
        saved = _whole(p, keeper, group, me, small.layout, *_keys_and_dtypes(p, keeper, group, me))
    meta = dict(small.meta, world_size=p.world)
    cstate.apply(ts, saved, small.extras, None, meta, True, True, False, shards)
    mine = None
    if p.world == world:  # same size: rank r continues old rank r's random streams
        mine = snap.with_part(small, _broadcast_per_rank(p, keeper, group, me, world))
        snap.set_rng_objects(mine.rng)
    return p.step, "ok", mine


def _broadcast_per_rank(p: Plan, keeper: Keeper, group, me: int, world: int) -> bytes:
    """Old rank r's own state (RNG, compression), delivered to new rank r (each holder
    broadcasts in turn)."""
    mine = None
    for old in range(world):
        src, where = p.sources[old]
        data = keeper.get(where, p.step).rank_part() if me == src else None
        got = _broadcast_bytes(data, src, group, me)
        if old == me:
            mine = got
    return mine
