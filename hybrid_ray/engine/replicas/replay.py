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
from ..zero.update import step_masters
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
    arrived: Any = None  # gradients received on a GPU: the CUDA event after which they are there

    def mark_arrived(self) -> None:
        """Record, on the receiving thread's stream, that the gradients have arrived: the
        buddy steps its copy on a stream of its own, which waits for this event."""
        if self.grads and any(g.is_cuda for g in self.grads):
            self.arrived = torch.cuda.Event()
            self.arrived.record()


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
    """The optimizer over a held copy's tensors, built from the owner's spec.

    owners_kernel=False: the copy is in host memory and steps with the CPU's fastest kernel.
    True (`replay_on: device`): each tensor lies where the owner's master does, and the copy
    steps with the owner's own implementation flags (fused or foreach, on the owner's device),
    on a CUDA stream of its own when on a GPU, so it stays bitwise equal to the owner's shard.
    """

    def __init__(self, spec: dict, tensors: List[snap.Tensors], owners_kernel: bool = False):
        module, name = spec["cls"]
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        impl = {} if owners_kernel else cpu_optimizer_kwargs(cls)
        self.params = [torch.nn.Parameter(t["master"], requires_grad=True) for t in tensors]
        self.stream = torch.cuda.Stream() if any(p.is_cuda for p in self.params) else None
        groups: List[dict] = []
        kept = () if owners_kernel else _IMPLEMENTATION
        for i, hyper in enumerate(spec["groups"]):
            own = {k: v for k, v in hyper.items() if k not in kept}
            if not owners_kernel and ("fused" in hyper or "foreach" in hyper):
                own.update(fused=impl.get("fused"), foreach=impl.get("foreach"))
            own["params"] = [p for p, g in zip(self.params, spec["space_group"]) if g == i]
            groups.append(own)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in spec["defaults"].items() if k in accepted and k not in kept}
        self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        self._groups = [g for g in groups if g["params"]]
        self._group_index = [i for i, g in enumerate(groups) if g["params"]]
        for p, t, g in zip(self.params, tensors, spec["space_group"]):
            state = {k: v for k, v in t.items() if k != "master"}
            if state:  # the optimizer has stepped: its scalars (Adam's step) go with the moments
                # where torch's Adam keeps its step count: on the parameter's device for the
                # fused and capturable kernels, on the CPU otherwise
                hyper = spec["groups"][g] if owners_kernel else {}
                where = p.device if hyper.get("fused") or hyper.get("capturable") else torch.device("cpu")
                state.update({k: (v.to(where, copy=True) if torch.is_tensor(v) else v)
                              for k, v in spec["scalars"].items()})
                self.optimizer.state[p] = state

    def apply(self, pending: Pending) -> None:
        """The owner's update (zero/optimizer.py step_masters) with the step's hyperparameters."""
        if pending.grads is None:
            return
        for group, i in zip(self._groups, self._group_index):
            group.update({k: v for k, v in pending.hyper[i].items() if k not in _IMPLEMENTATION})
        frozen = FrozenStep(*pending.frozen) if pending.frozen is not None else None
        if self.stream is None:
            step_masters(self.params, pending.grads, pending.coef, self.optimizer, frozen)
            return
        # Off the training stream, after the gradients arrived; finished before this returns,
        # so that a recovery reading the copy (under the keeper's lock) sees the whole step.
        with torch.cuda.stream(self.stream):
            if pending.arrived is not None:
                self.stream.wait_event(pending.arrived)
            step_masters(self.params, pending.grads, pending.coef, self.optimizer, frozen)
        self.stream.synchronize()


def header(step: int, coef: float, hyper: Optional[List[dict]], part: bytes,
           frozen: Optional[FrozenStep] = None) -> bytes:
    return snap.pack({"step": step, "coef": coef, "hyper": hyper, "part": part,
                      "frozen": None if frozen is None else tuple(frozen)})


def pending_from(data: bytes, grads: Optional[List[torch.Tensor]]) -> Pending:
    h: Dict[str, Any] = snap.unpack(data)
    return Pending(h["step"], grads, h["coef"], h["hyper"], h["part"], h.get("frozen"))
