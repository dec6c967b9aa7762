"""Replay mode: the buddy steps its copy of a rank's shard with the rank's reduced gradient.

Instead of the updated shard (12 bytes per element with Adam), each step sends the reduced
gradient shard (4 bytes per element) and a few scalars: the clip coefficient, whether the step
was applied (an fp16 overflow skips it), the optimizer's hyperparameters for the step (the LR
schedule's), whether 1-bit Adam froze the variance (its "gradient" is then the averaged
momentum in the momentum form), and the rank's own state (RNG, compression residuals). The buddy
applies the same optimizer update to its copy; with the same kernel and dtype (both on the CPU:
a CPU engine, or optimizer offload) the copy stays bitwise equal to the owner's shard.

A copy needs a base: after the ring's first step, and whenever a precision switch lays the
shards out anew, the rank sends its whole shard once (as copy mode does), with what the buddy
needs to build the same optimizer (`optimizer_spec`).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ..checkpoint.state import TrainState
from ..zero.frozen import FrozenStep
from ..zero.offload import cpu_optimizer_kwargs
from ..zero.optimizer import step_masters
from ..zero.relayout import scalar_state
from . import snapshot as snap

# Group keys that choose an implementation for the owner's device: the copy picks its own.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


@dataclass
class Pending:
    """The buddy's step `step`, received and committed, not yet applied to the copy."""

    step: int
    grads: Optional[List[torch.Tensor]]  # per space, the reduced shard (None: the step was skipped)
    coef: float
    hyper: Optional[List[dict]]  # per optimizer group, without its params
    part: bytes  # the rank's own state after the step (snapshot.Snapshot.rank_part)
    frozen: Optional[tuple] = None  # 1-bit Adam after its warm-up: the step's FrozenStep fields


def hyperparameters(optimizer: torch.optim.Optimizer) -> List[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def optimizer_spec(ts: TrainState) -> dict:
    """What the buddy needs to build an optimizer that steps its copy as this one steps the
    shard: the class, its hyperparameters per group, each space's group, the scalar state."""
    opt = ts.optimizer
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    scalars = {k: (v.detach().cpu() if torch.is_tensor(v) else v)
               for k, v in scalar_state(opt, ts.masters).items()}
    return {"cls": (type(opt).__module__, type(opt).__qualname__), "defaults": dict(opt.defaults),
            "groups": hyperparameters(opt), "space_group": [group_of[id(m)] for m in ts.masters],
            "scalars": scalars}


class Stepper:
    """The optimizer over a held copy's tensors (host memory), built from the owner's spec."""

    def __init__(self, spec: dict, tensors: List[snap.Tensors]):
        module, name = spec["cls"]
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        impl = cpu_optimizer_kwargs(cls)
        self.params = [torch.nn.Parameter(t["master"], requires_grad=True) for t in tensors]
        groups: List[dict] = []
        for i, hyper in enumerate(spec["groups"]):
            own = {k: v for k, v in hyper.items() if k not in _IMPLEMENTATION}
            if "fused" in hyper or "foreach" in hyper:
                own.update(fused=impl.get("fused"), foreach=impl.get("foreach"))
            own["params"] = [p for p, g in zip(self.params, spec["space_group"]) if g == i]
            groups.append(own)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in spec["defaults"].items() if k in accepted and k not in _IMPLEMENTATION}
        self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        self._groups = [g for g in groups if g["params"]]
        self._group_index = [i for i, g in enumerate(groups) if g["params"]]
        for p, t in zip(self.params, tensors):
            state = {k: v for k, v in t.items() if k != "master"}
            if state:  # the optimizer has stepped: its scalars (Adam's step) go with the moments
                state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in spec["scalars"].items()})
                self.optimizer.state[p] = state

    def apply(self, pending: Pending) -> None:
        """The owner's update (zero/optimizer.py step_masters) with the step's hyperparameters."""
        if pending.grads is None:
            return
        for group, i in zip(self._groups, self._group_index):
            group.update({k: v for k, v in pending.hyper[i].items() if k not in _IMPLEMENTATION})
        frozen = FrozenStep(*pending.frozen) if pending.frozen is not None else None
        step_masters(self.params, pending.grads, pending.coef, self.optimizer, frozen)


def header(step: int, coef: float, hyper: Optional[List[dict]], part: bytes,
           frozen: Optional[FrozenStep] = None) -> bytes:
    return snap.pack({"step": step, "coef": coef, "hyper": hyper, "part": part,
                      "frozen": None if frozen is None else tuple(frozen)})


def pending_from(data: bytes, grads: Optional[List[torch.Tensor]]) -> Pending:
    h: Dict[str, Any] = snap.unpack(data)
    return Pending(h["step"], grads, h["coef"], h["hyper"], h["part"], h.get("frozen"))
