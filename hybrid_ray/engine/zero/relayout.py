"""Moving fp32 state between the sharded flat layout and one tensor per parameter.

Used whenever the layout changes under a running job: a precision switch (parameters move to
flat spaces of another dtype) and loading a checkpoint at another world size. The fp32
master values and every per-element optimizer state (Adam's moments, SGD's momentum) travel;
scalar state such as Adam's step count is kept as is.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .. import comm
from .flat import FlatSpace
from ..topology import Topology

ParamState = Dict[int, Dict[str, torch.Tensor]]  # id(param) -> {"master": t, "exp_avg": t, ...}


def full_flat(space: FlatSpace, shard: torch.Tensor, topo: Topology) -> torch.Tensor:
    """The whole flat-sized tensor, from every rank's shard of it (one all-gather per bucket)."""
    if space.num_shards == 1:
        return shard
    shard = shard.to(space.device)  # offloaded masters live on the host; NCCL gathers device tensors
    full = torch.empty(space.numel, dtype=shard.dtype, device=space.device)
    for bucket, lo, hi, off in space.shard_slices():
        comm.all_gather(full[bucket.start:bucket.start + bucket.numel], shard[off:off + hi - lo],
                        group=topo.group)
    return full


def shard_from_params(space: FlatSpace, values: Dict[int, torch.Tensor]) -> torch.Tensor:
    """This rank's fp32 shard of a space, filled from one full tensor per parameter."""
    full = torch.zeros(space.numel, dtype=torch.float32, device=space.device)
    for p, off in space.param_offsets():
        full[off:off + space.shapes[id(p)].numel()].copy_(values[id(p)].reshape(-1))
    return space.gather_shard(full)


def export_state(spaces: List[FlatSpace], masters: List[torch.Tensor],
                 optimizer: torch.optim.Optimizer, topo: Topology) -> ParamState:
    """Full fp32 master and per-element optimizer state of every parameter (on its device)."""
    out: ParamState = {}
    for space, master in zip(spaces, masters):
        tensors = {"master": master.detach()}
        state = optimizer.state.get(master, {})
        for key in sorted(state):  # one order on every rank: the gathers below are collective
            value = state[key]
            if torch.is_tensor(value) and value.shape == master.shape:
                tensors[key] = value
        fulls = {key: full_flat(space, t, topo) for key, t in tensors.items()}
        for p, off in space.param_offsets():
            shape = space.shapes[id(p)]  # not p.shape: a released stage-3 parameter is empty
            out[id(p)] = {key: f[off:off + shape.numel()].view(shape).clone() for key, f in fulls.items()}
    return out


def scalar_state(optimizer: torch.optim.Optimizer, masters: List[torch.Tensor]) -> Dict[str, object]:
    """Optimizer state that is not per element (e.g. Adam's step), from the first master."""
    for master in masters:
        state = optimizer.state.get(master, {})
        if state:
            return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.shape == master.shape)}
    return {}


def import_state(spaces: List[FlatSpace], masters: List[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, state: ParamState, scalars: Dict[str, object]) -> None:
    """Fill masters and optimizer state of a (new) layout from per-parameter state."""
    for space, master in zip(spaces, masters):
        keys = set().union(*(state[id(p)].keys() for p in space.params)) if space.params else set()
        with torch.no_grad():
            master.copy_(shard_from_params(space, {id(p): state[id(p)]["master"] for p in space.params}))
        # Partial offload: host and device masters each keep their scalars (Adam's step) where
        # their fused kernel reads them.
        entry = {k: (v.to(master.device, copy=True) if torch.is_tensor(v) else v) for k, v in scalars.items()}
        for key in sorted(keys - {"master"}):  # sorted: a set's order differs between processes
            values = {id(p): state[id(p)][key] for p in space.params}
            entry[key] = shard_from_params(space, values).to(master.device)  # host when offloaded
        if len(entry) > len(scalars) or scalars:
            optimizer.state[master] = entry


def import_shards(masters: List[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                  shards: List[Dict[str, torch.Tensor]], scalars: Dict[str, object]) -> None:
    """Fill masters and optimizer state from shards already in this layout (per space: "master"
    and the per-element state), as `import_state` would from whole parameters, without cutting
    and re-flattening them: a copy of this same rank's shard."""
    for master, shard in zip(masters, shards):
        with torch.no_grad():
            master.copy_(shard["master"].view_as(master))
        entry = {k: (v.to(master.device, copy=True) if torch.is_tensor(v) else v) for k, v in scalars.items()}
        for key in sorted(k for k in shard if k != "master"):
            entry[key] = shard[key].to(master.device, copy=True).view_as(master)
        if len(entry) > len(scalars) or scalars:
            optimizer.state[master] = entry


def consolidated_state_dict(module: torch.nn.Module, spaces: List[FlatSpace],
                            masters: List[torch.Tensor], topo: Topology, dtype: torch.dtype,
                            rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """The whole model's state (parameters from the fp32 masters, plus buffers) on the CPU.

    Space by space: every rank all-gathers one space's master at a time, so no rank ever holds
    more than one space in full on its device; the result accumulates in host memory on rank 0
    (on every rank with rank0_only=False). Tied parameters appear under each of their names, as
    in `module.state_dict()`.
    """
    keep = topo.rank == 0 or not rank0_only
    values: Dict[int, torch.Tensor] = {}
    for space, master in zip(spaces, masters):
        full = full_flat(space, master.detach(), topo)
        if keep:
            for p, off in space.param_offsets():
                shape = space.shapes[id(p)]
                values[id(p)] = full[off:off + shape.numel()].view(shape).to("cpu", dtype)
        del full
    if not keep:
        return {}
    out: Dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = values[id(p)] if id(p) in values else p.detach().to("cpu", dtype)
    for name, b in module.named_buffers(remove_duplicate=False):
        out[name] = b.detach().to("cpu")
    return out
