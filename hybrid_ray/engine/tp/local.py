"""Tensor parallelism with plain local parameters: torch's parallelize_module splits the
weights and installs the input/output redistributions; then each DTensor parameter is replaced
by a plain Parameter holding this rank's shard, and the module sees a DTensor view of it only
while it runs.

Why not keep the DTensor parameters: everything downstream (ZeRO's flat buffers and reducer,
stage 3's gathering, precision casts, checkpoints) works on plain tensors and stays as it is;
the shard is just a smaller parameter. DTensor.from_local is differentiable, and its backward
returns the gradient in the forward's placement: the gradient of a replicated weight that a
sequence-parallel norm produces as a partial sum is all-reduced over the tensor-parallel ranks
right there, before ZeRO sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ...config import ConfigError
from .plan import resolve_plan


@dataclass
class TensorParallelModel:
    """What applying a plan left behind.

    replicated: ids of the parameters whose values are the same on every tensor-parallel rank
      (outside the plan, or replicated by it): the gradient norm counts them once.
    renamed: id of each parameter before -> the parameter that replaced it (its local shard).
    placements: parameter name -> the DTensor placements of its shard.
    parts: parameter name -> how many side-by-side parts its rows are (a fused q, k, v: each
      part is split, not the whole); 1 for the rest.
    """

    replicated: set = field(default_factory=set)
    renamed: Dict[int, nn.Parameter] = field(default_factory=dict)
    placements: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)
    parts: Dict[str, int] = field(default_factory=dict)


def apply_plan(model: nn.Module, plan: Mapping[str, Any], tp_mesh: Any,
               check: Optional[Callable[[set], set]] = None) -> TensorParallelModel:
    """Split `model` across `tp_mesh` in place (collective over the tensor-parallel group;
    `check`: see resolve_plan)."""
    styles = resolve_plan(model, plan, check)
    group = tp_mesh.get_group()
    for t in list(model.parameters()) + list(model.buffers()):  # one starting point per replica
        dist.broadcast(t.data, group_src=0, group=group)
    before = dict(model.named_parameters(remove_duplicate=False))
    parallelize_module(model, tp_mesh, styles)
    out = TensorParallelModel()
    for mod_name, module in model.named_modules():
        specs = _localize(module)
        for pname, spec in specs.items():
            out.placements[_join(mod_name, pname)] = spec[1]
            out.parts[_join(mod_name, pname)] = getattr(styles.get(mod_name), "chunks", 1)
    _retie(model, before, out.placements)
    after = dict(model.named_parameters(remove_duplicate=False))
    for name, old in before.items():
        out.renamed[id(old)] = after[name]
    sharded = {id(after[n]) for n, pl in out.placements.items() if any(x.is_shard() for x in pl)}
    out.replicated = {id(p) for p in after.values() if id(p) not in sharded}
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _localize(module: nn.Module) -> Dict[str, Tuple[Any, Any, Any, Any]]:
    specs = {}
    for name, p in list(module._parameters.items()):
        if isinstance(p, DTensor):
            for pl in p.placements:  # even shards: every rank's the same shape (checkpoints join them)
                if pl.is_shard() and p.shape[pl.dim] % p.device_mesh.size():
                    raise ConfigError(f"tp_plan: {type(module).__name__}.{name} has {p.shape[pl.dim]} "
                                      f"along the split dimension {pl.dim}, not a multiple of the "
                                      f"tensor-parallel size {p.device_mesh.size()}")
            specs[name] = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
            module._parameters[name] = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
    if specs:
        module.register_forward_pre_hook(partial(_attach, specs))
        module.register_forward_hook(partial(_detach, specs), always_call=True)
    return specs


def _attach(specs: Dict[str, Tuple], module: nn.Module, args: Any) -> None:
    # An instance attribute shadows the registered parameter for the forward only: the module's
    # code reads self.weight and gets the DTensor view of its local shard.
    for name, (mesh, placements, shape, stride) in specs.items():
        module.__dict__[name] = DTensor.from_local(module._parameters[name], mesh, placements,
                                                   run_check=False, shape=shape, stride=stride)


def _detach(specs: Dict[str, Tuple], module: nn.Module, args: Any, output: Any) -> None:
    for name in specs:
        module.__dict__.pop(name, None)


def _retie(model: nn.Module, before: Dict[str, nn.Parameter], placements: Dict[str, Tuple]) -> None:
    """Names that shared one parameter before the split share one shard after it (a GPT's
    embedding and output head), provided the plan split them the same way."""
    ties: Dict[int, List[str]] = {}
    for name, p in before.items():
        ties.setdefault(id(p), []).append(name)
    modules = dict(model.named_modules())
    for names in (n for n in ties.values() if len(n) > 1):
        layouts = {n: placements.get(n) for n in names}
        if len(set(layouts.values())) > 1:
            raise ConfigError("tp_plan: tied weights are split differently ("
                              + ", ".join(f"{n}: {v or 'whole'}" for n, v in layouts.items())
                              + "); give them styles that shard the shared weight the same way, or untie them")
        first = _owner(modules, names[0])
        keep = first[0]._parameters[first[1]]
        for n in names[1:]:
            module, attr = _owner(modules, n)
            module._parameters[attr] = keep


def _owner(modules: Dict[str, nn.Module], name: str) -> Tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return modules[prefix], attr
