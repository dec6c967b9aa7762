"""Moving fp32 state between the sharded flat layout and one tensor per parameter.

Used whenever the layout changes under a running job: a precision switch (parameters move to
flat spaces of another dtype) and loading a checkpoint at another world size. The fp32
master values and every per-element optimizer state (Adam's moments, SGD's momentum) travel;
scalar state such as Adam's step count is kept as is.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch

from .. import comm
from .flat import FlatSpace
from ..topology import Topology

ParamState = Dict[int, Dict[str, torch.Tensor]]  # id(param) -> {"master": t, "exp_avg": t, ...}


def param_values(space: FlatSpace, shard: torch.Tensor,
                 topo: Topology) -> Iterator[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, its whole value) for every parameter of a space, from every rank's shard.

    One bucket at a time: each bucket is all-gathered into one bucket-sized buffer on the
    space's device, and its parameters' values are yielded as views of it, valid until the
    iteration moves on (copy what you keep). So a save, a consolidation or a re-layout needs
    one bucket of free device memory, not the whole space in fp32 (40 GB at 10B), and an
    offloaded shard moves to the device a bucket at a time. With one shard (stage 0) the views
    are of the shard itself.
    """
    if space.num_shards == 1:
        for p, off in space.param_offsets():
            yield p, shard[off:off + space.shapes[id(p)].numel()].view(space.shapes[id(p)])
        return
    if not space.buckets:
        return
    largest = max(b.numel for b in space.buckets)
    buf = torch.empty(largest, dtype=shard.dtype, device=space.device)
    for bucket, lo, hi, off in space.shard_slices():
        out = buf[:bucket.numel]
        comm.all_gather(out, shard[off:off + hi - lo].to(space.device), group=topo.group)
        for p, start in zip(bucket.params, bucket.offsets):
            shape = space.shapes[id(p)]  # not p.shape: a released stage-3 parameter is empty
            begin = start - bucket.start
            yield p, out[begin:begin + shape.numel()].view(shape)


def shard_from_params(space: FlatSpace, values: Dict[int, torch.Tensor],
                      device: torch.device) -> torch.Tensor:
    """This rank's fp32 shard of a space on `device`, cut from one whole tensor per parameter
    (wherever those live): only the parameters' pieces inside this rank's slices are copied."""
    shard = torch.zeros(space.shard_numel, dtype=torch.float32, device=device)
    for bucket, lo, hi, off in space.shard_slices():
        for p, start in zip(bucket.params, bucket.offsets):
            n = space.shapes[id(p)].numel()
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                piece = values[id(p)].reshape(-1)[a - start:b - start]
                shard[off + a - lo:off + b - lo].copy_(piece)
    return shard


def export_state(spaces: List[FlatSpace], masters: List[torch.Tensor],
                 optimizer: torch.optim.Optimizer, topo: Topology) -> ParamState:
    """Full fp32 master and per-element optimizer state of every parameter, each where its
    master lives (host memory for an offloaded space)."""
    out: ParamState = {}
    for space, master in zip(spaces, masters):
        tensors = {"master": master.detach()}
        state = optimizer.state.get(master, {})
        for key in sorted(state):  # one order on every rank: the gathers below are collective
            value = state[key]
            if torch.is_tensor(value) and value.shape == master.shape:
                tensors[key] = value
        for key, t in tensors.items():
            for p, value in param_values(space, t, topo):
                out.setdefault(id(p), {})[key] = value.to(t.device, copy=True)
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
            master.copy_(shard_from_params(space, {id(p): state[id(p)]["master"] for p in space.params},
                                           master.device))
        # Partial offload: host and device masters each keep their scalars (Adam's step) where
        # their fused kernel reads them.
        entry = {k: (v.to(master.device, copy=True) if torch.is_tensor(v) else v) for k, v in scalars.items()}
        for key in sorted(keys - {"master"}):  # sorted: a set's order differs between processes
            values = {id(p): state[id(p)][key] for p in space.params}
            entry[key] = shard_from_params(space, values, master.device)  # host when offloaded
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

    Bucket by bucket: every rank all-gathers one bucket of masters at a time, so no rank holds
    more than one bucket in full on its device; the result accumulates in host memory on rank 0
    (on every rank with rank0_only=False). Tied parameters appear under each of their names, as
    in `module.state_dict()`.
    """
    keep = topo.rank == 0 or not rank0_only
    values: Dict[int, torch.Tensor] = {}
    for space, master in zip(spaces, masters):
        for p, value in param_values(space, master.detach(), topo):
            if keep:
                values[id(p)] = value.to("cpu", dtype, copy=True)
    if not keep:
        return {}
    out: Dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = values[id(p)] if id(p) in values else p.detach().to("cpu", dtype)
    for name, b in module.named_buffers(remove_duplicate=False):
        out[name] = b.detach().to("cpu")
    return out
