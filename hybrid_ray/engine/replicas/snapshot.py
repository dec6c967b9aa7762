"""One rank's training state as host tensors: what a buddy keeps and a recovery rebuilds from.

A snapshot is this rank's shard of every flat space (fp32 master and per-element optimizer
state, in the sharded layout, no collective), plus small state that a disk checkpoint keeps in
its meta file (counters, loss scaler, LR schedule, optimizer scalars, data position), this
rank's RNG states, the module's buffers and frozen parameters, and a description of the flat
layout by parameter name. The layout description is what lets a group of another size rebuild
whole parameters from the shards: the shards are slices of buckets, not of parameters.
"""
from __future__ import annotations

import io
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..checkpoint import state as cstate
from ..checkpoint.state import TrainState

Tensors = Dict[str, torch.Tensor]


@dataclass
class Snapshot:
    """This rank's state after optimizer step `step`, taken in a group of `world` ranks."""

    step: int
    rank: int
    world: int
    tensors: List[Tensors]  # per flat space: key ("master", "exp_avg", ...) -> host shard
    small: bytes  # pickled SmallState
    run: Optional[str] = None  # the checkpoint directory of the run (the engine's newest load/save)
    token: int = 0  # the ring that made it (keeper.begin)
    # Replay mode's copy of the buddy's shard, stepped here: its rank part (RNG, compression) at
    # `step` when `small` (the rank-independent rest) has gone stale, and the optimizer that
    # steps `tensors` (replay.Stepper).
    part: Optional[bytes] = None
    stepper: Any = None
    live: bool = False  # replay mode's own entry: the engine's tensors by reference, not a copy
    # Tensors over memory this process does not own (a warm spare's copy, read-only in Ray's
    # object store): read, never reused as a later copy's buffers.
    borrowed: bool = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.tensors for t in ts.values()) + len(self.small)

    @property
    def full(self) -> bool:
        """Whether `small` holds this step's counters, schedule and layout (else only `part`)."""
        return bool(self.small)

    def rank_part(self) -> bytes:
        """The state of this rank alone (its RNG and compression state), serialized."""
        if self.part is not None:
            return self.part
        small = parse_small(self.small)
        return pack({"rng": small.rng, "rank": small.rank})


@dataclass
class SmallState:
    meta: dict  # as a checkpoint's meta.json: counters, scaler, schedule, optimizer scalars, data
    rng: dict  # this rank's generators
    extras: Tensors  # persistent buffers and frozen parameters (rank-independent under data parallelism)
    layout: List[dict] = field(default_factory=list)  # per space: numel, shards, buckets, params
    rank: dict = field(default_factory=dict)  # other state of this rank (the engine's: compression)
    stepper: dict = field(default_factory=dict)  # replay mode: how the buddy builds the optimizer


def layout(ts: TrainState) -> List[dict]:
    """Per flat space: where each parameter lies in the flat buffer and how buckets are cut."""
    names = cstate.param_names(ts)
    out = []
    for space in ts.spaces:
        out.append({"numel": space.numel, "num_shards": space.num_shards,
                    "buckets": [(b.start, b.numel) for b in space.buckets],
                    "params": [(names[id(p)], off, tuple(space.shapes[id(p)])) for p, off in space.param_offsets()]})
    return out


def shard_tensors(ts: TrainState) -> List[Tensors]:
    """Per space, the live tensors a snapshot copies: master shard and per-element state."""
    out = []
    for master in ts.masters:
        state = ts.optimizer.state.get(master, {})
        tensors = {"master": master.detach()}
        tensors.update({k: v for k, v in sorted(state.items()) if torch.is_tensor(v) and v.shape == master.shape})
        out.append(tensors)
    return out


def rng_objects() -> dict:
    out: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    return out


def set_rng_objects(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def extras(ts: TrainState) -> Tensors:
    """Persistent buffers and parameters outside the flat spaces, on the host."""
    trained = {id(p) for s in ts.spaces for p in s.params}
    out = {n: p.detach().to("cpu", copy=True) for n, p in ts.module.named_parameters() if id(p) not in trained}
    keys = set(ts.module.state_dict(keep_vars=True))
    for name, b in ts.module.named_buffers():
        if name in keys:  # persistent only: the others are rebuilt by the module itself
            out[name] = b.detach().to("cpu", copy=True)
    return out


def small_state(ts: TrainState, space_layout: List[dict], rank_state: dict, stepper: Optional[dict] = None) -> bytes:
    meta = cstate.meta(ts, f"global_step{ts.counters.global_steps}", {}, [], {})
    state = SmallState(meta, rng_objects(), extras(ts), space_layout, rank_state, stepper or {})
    return pack(state.__dict__)


def pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)  # tensors and numpy arrays inside, so torch's pickler
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def parse_small(data: bytes) -> SmallState:
    return SmallState(**unpack(data))


def with_part(small: SmallState, part: bytes) -> SmallState:
    """`small` (another rank's, at the same step) with the rank part of the one it stands for."""
    mine = unpack(part)
    return SmallState(small.meta, mine["rng"], small.extras, small.layout, mine["rank"], small.stepper)


def copy_into(live: List[Tensors], into: Optional[List[Tensors]], pin: bool) -> List[Tensors]:
    """Host copies of `live`, reusing `into` where it has the same shapes (non-blocking from a GPU:
    the caller synchronises before reading them)."""
    out = []
    for i, tensors in enumerate(live):
        reuse = into[i] if into is not None and i < len(into) else {}
        copies = {}
        for key, t in tensors.items():
            buf = reuse.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            buf.copy_(t, non_blocking=pin and t.is_cuda)
            copies[key] = buf
        out.append(copies)
    return out


def empty_like(tensors: List[Tensors], pin: bool) -> List[Tensors]:
    return [{k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in ts.items()} for ts in tensors]
