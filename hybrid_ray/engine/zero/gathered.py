"""Reading and changing stage-3 parameters outside forward (DeepSpeed's GatheredParameters).

Between uses a stage-3 parameter is an empty tensor; its values live in the unit's local shard
(storage dtype) and in the fp32 master shard the optimizer steps. `gather` makes the requested
parameters whole by gathering their units as forward would; `write_back` makes one rank's
changes everyone's: the changed parameters are broadcast, and every rank's slice of them goes
into both its local shard and its fp32 master, so the next forward and the next optimizer step
both start from the modified weights (DeepSpeed leaves its fp32 partitions stale there).

Only elements whose value changed are written into the masters: a parameter that was gathered
with a modifier rank but left as it was keeps its full fp32 master, not the value rounded to its
half-precision storage.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..topology import Topology

ACCESS_ATTR = "_hybrid_ray_stage3"


def access_of(p: torch.Tensor) -> Optional["Stage3Params"]:
    """The live engine-side access for a stage-3 parameter, or None."""
    ref = getattr(p, ACCESS_ATTR, None)
    return ref() if ref is not None else None


class Stage3Params:
    """Which space (and unit) holds each parameter of one stage-3 engine."""

    def __init__(self, spaces: Sequence, units: Sequence, zero, topo: Topology):
        self.spaces, self.units, self.zero, self.topo = list(spaces), list(units), zero, topo
        self.where: Dict[int, int] = {}
        self._params: List[nn.Parameter] = []
        ref = weakref.ref(self)  # parameters outlive an engine: hold it weakly
        for i, space in enumerate(self.spaces):
            for p in space.params:
                self.where[id(p)] = i
                self._params.append(p)
                setattr(p, ACCESS_ATTR, ref)
                p.ds_shape, p.ds_numel = space.shapes[id(p)], space.shapes[id(p)].numel()

    def detach(self) -> None:
        for p in self._params:
            if getattr(p, ACCESS_ATTR, None) is not None and access_of(p) is self:
                delattr(p, ACCESS_ATTR)
        self._params.clear()

    def gather(self, params: Sequence[nn.Parameter]) -> list:
        """Make `params` whole; returns the units this gathered (release them with `release`).

        Collective: every rank passes the same parameters. A delayed update still in flight
        lands first, so what is read is the last step's weights.
        """
        self.zero.flush()
        started = []
        for i in self._space_indices(params):
            unit = self.units[i]
            if unit is not None and not unit.gathered:
                unit.gather()
                started.append(unit)
        for unit in started:
            unit.wait()
        return started

    @staticmethod
    def release(units: list) -> None:
        for unit in units:
            unit.release()

    @torch.no_grad()
    def write_back(self, params: Sequence[nn.Parameter], src: int) -> None:
        """Broadcast `params` from group rank `src` and store everyone's slice of the result in
        the local shards and the fp32 masters (collective; the parameters are whole)."""
        group = self.topo.group
        src_global = dist.get_global_rank(group or dist.group.WORLD, src)
        for p in params:
            if id(p) in self.where:
                dist.broadcast(p.data, src=src_global, group=group)
        for i in self._space_indices(params):
            self._store(self.spaces[i], self.zero.masters[i])

    def _store(self, space, master: torch.Tensor) -> None:
        new = space.gather_shard(space.flat)
        old = master.detach().to(new.device, space.dtype)
        changed = new != old
        if bool(changed.any()):
            master.data[changed.to(master.device)] = new[changed].to(master.device, master.dtype)
        if space.local_shard is not None:
            space.local_shard.copy_(new)

    def _space_indices(self, params: Sequence[nn.Parameter]) -> List[int]:
        """Spaces holding any of `params`, in space order (the same on every rank)."""
        wanted = {self.where[id(p)] for p in params if id(p) in self.where}
        return sorted(wanted)
