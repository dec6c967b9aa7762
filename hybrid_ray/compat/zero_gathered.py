"""`zero.GatheredParameters`: partitioned parameters whole for the length of a block.

    with hybrid_ray.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.copy_(pretrained)     # seen by every rank after the block

Three kinds of parameter, each handled where its values live:
- under a stage-3 engine: its unit is gathered as forward would; with a modifier rank the
  changes are broadcast and stored in every rank's local shard and fp32 master, so training
  continues from them (engine/zero/gathered.py);
- built under zero.Init, before initialize: gathered from the per-parameter shards; with a
  modifier rank every rank keeps its slice of that rank's values;
- anything else (stages 0-2, one rank, an ordinary tensor): whole already, passed through, and
  nothing is broadcast (as in DeepSpeed).
Collective for partitioned parameters: every rank enters with the same parameters.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
import torch.nn as nn

from ..engine import register_external_parameter
from ..engine.zero import partition as zp
from ..engine.zero.gathered import access_of
from ..engine.zero.partition import ZeroParamStatus

__all__ = ["GatheredParameters", "register_external_parameter", "ZeroParamStatus"]


class GatheredParameters:
    """DeepSpeed's `zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)`.

    params: one parameter or an iterable of them. modifier_rank: the rank (in the parameters'
    group) whose changes inside the block are kept; None: read only, changes are discarded.
    fwd_module is accepted for signature compatibility: declare parameters used outside their
    module's forward with register_external_parameter instead.
    """

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._engine = [p for p in self.params if access_of(p) is not None]
        self._init = [p for p in self.params if access_of(p) is None and zp.is_partitioned(p)
                      and p.ds_status == zp.ZeroParamStatus.NOT_AVAILABLE]
        self._units: list = []

    def __enter__(self) -> "GatheredParameters":
        with torch._C.DisableTorchFunction():  # zero.Init's mode must not see our bookkeeping
            for access, params in _by_access(self._engine):
                self._units.append((access, access.gather(params)))
            for p in self._init:
                zp.gather(p)
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            try:
                if self.modifier_rank is not None and exc[0] is None:
                    for access, params in _by_access(self._engine):
                        access.write_back(params, self.modifier_rank)
                    for p in self._init:
                        zp.partition_of(p).set_from(p.data, src=self.modifier_rank)
            finally:
                for access, units in self._units:
                    access.release(units)
                for p in self._init:
                    zp.release(p)


def _as_list(params: Any) -> List[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    out, seen = [], set()
    for p in params:
        if isinstance(p, torch.Tensor) and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _by_access(params: Iterable[nn.Parameter]):
    """(engine access, its parameters) in first-seen order (the same on every rank)."""
    groups: dict = {}
    for p in params:
        access = access_of(p)
        groups.setdefault(id(access), (access, []))[1].append(p)
    return list(groups.values())
