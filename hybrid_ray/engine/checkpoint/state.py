"""What a checkpoint holds: taken from a live engine's TrainState (a snapshot) and put back into one.

The snapshot runs on the training thread and is the only part of an asynchronous save that
blocks training: parameter state is all-gathered space by space (collective) and copied into
host tensors; everything after it (serialising, checksums, writing, the commit) works on those
copies only. Nothing here touches storage.

Per-parameter state (fp32 master, per-element optimizer state such as Adam's moments) is saved by
parameter name; `owners` spreads the names over the ranks by size, so each writes about 1/N. Rank 0
also saves the module's other tensors: its persistent buffers and the frozen parameters (those
outside the engine's flat spaces), so that an offline export is a complete `state_dict`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from hybrid_ray.config import Config

from ..topology import Topology
from ..zero import relayout
from ..zero.flat import FlatSpace
from . import read as cread
from . import storage as cio
from .buffers import HostBuffers  # noqa: F401 - re-exported: callers import it from here
from .rng import rng_problem, rng_state, set_rng_state  # noqa: F401 - re-exported as well
from .split import SplitLayout, merge_index, merge_layouts
from .storage import CheckpointError

Tensors = Dict[str, torch.Tensor]


@dataclass
class StepCounters:
    """The engine's progress counters; a checkpoint saves and restores them as they are."""

    global_steps: int = 0  # optimizer steps taken (skipped ones included)
    skipped_steps: int = 0  # steps skipped for an fp16 overflow or a non-finite norm
    micro_steps: int = 0  # forward/backward/step calls
    global_samples: int = 0  # samples consumed by all ranks together


@dataclass(frozen=True)
class TrainState:
    """What a checkpoint saves from an engine and restores into it, named one by one.

    The engine builds one for each save and load (`Engine.train_state()`): a precision switch
    re-lays the parameters out into new flat spaces and masters, so none is kept between calls.
    """

    module: nn.Module
    spaces: Sequence[FlatSpace]  # the flat parameter spaces, in order
    masters: Sequence[torch.Tensor]  # this rank's fp32 master shard of each space
    optimizer: torch.optim.Optimizer  # steps the masters; holds per-element state by master
    master_device: torch.device  # where the masters live (the host with optimizer offload)
    topology: Topology
    config: Config
    precision: str  # the base dtype in force ("bf16", "fp16", "fp32")
    loss_scaler: Any  # state_dict()/load_state_dict()
    lr_scheduler: Any  # None, or state_dict()/load_state_dict()
    counters: StepCounters  # restored in place
    data_loader: Any  # training_dataloader: its (or its sampler's) state_dict is the data position
    write_back: Callable[[], None]  # copy the masters into the model's parameters
    log: Callable[..., None]  # (message, level=INFO) on rank 0
    split: Optional[SplitLayout] = None  # the model is split over processes (split.py)
    compressor: Any = None  # the gradient compressor (its warm-up position is saved, not its residuals;
    # the 1-bit momentum form folds what they owe into the saved momentum: Checkpointer._snapshot)


# ---- parameter state -------------------------------------------------------------------------
def param_names(ts: TrainState) -> Dict[int, str]:
    """id(param) -> name, tied parameters once under their first name."""
    return {id(p): n for n, p in ts.module.named_parameters()}


def _per_element_keys(ts: TrainState, master: torch.Tensor) -> List[str]:
    state = ts.optimizer.state.get(master, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape)


def owners(sizes: Dict[str, int], world_size: int) -> Dict[str, int]:
    """Which rank saves each parameter's state: largest first, to the rank with the fewest
    elements so far (ties: the lower rank), so every rank writes about 1/N of the bytes; every
    parameter carries the same state keys, so elements stand for bytes. The same on every rank:
    a pure function of names and sizes."""
    load = [0] * world_size
    out: Dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return out


def _ownership(ts: TrainState, names: Dict[int, str]) -> Tuple[Dict[str, Optional[int]], int]:
    """(name -> the rank that writes it, this rank) in the writers' numbering: the data-parallel
    ranks; with the model split, the world's ranks, each name written by one rank of the stage
    that holds it, and a weight tied across stages by the first of them only (None: not here)."""
    split = ts.split
    whole = (lambda n, shape: shape) if split is None else split.full_shape
    sizes = {names[id(p)]: whole(names[id(p)], s.shapes[id(p)]).numel() for s in ts.spaces for p in s.params}
    if split is None:
        return dict(owners(sizes, ts.topology.world_size)), ts.topology.rank
    stage = split.stage_first // split.stage_size
    earlier = set().union(*map(set, split.from_stages(sorted(sizes))[:stage]))
    owner: Dict[str, Optional[int]] = {n: None for n in earlier & set(sizes)}
    mine = {n: sizes[n] for n in sizes if n not in earlier}
    owner.update({n: split.stage_first + r for n, r in owners(mine, split.stage_size).items()})
    return owner, split.rank


def snapshot_params(ts: TrainState, buffers: HostBuffers) -> Tuple[Tensors, List[dict]]:
    """This rank's share of the per-parameter state on the host, and the index of all of it."""
    topo, names, split = ts.topology, param_names(ts), ts.split
    owner, me = _ownership(ts, names)
    whole = (lambda n, t: t) if split is None else split.unshard
    shape_of = (lambda n, shape: shape) if split is None else split.full_shape
    out: Tensors = {}
    index: List[dict] = []
    per_space = []
    for space, master in zip(ts.spaces, ts.masters):
        tensors = {"master": master.detach()}
        tensors.update({k: ts.optimizer.state[master][k] for k in _per_element_keys(ts, master)})
        per_space.append((space, tensors))
    buffers.reserve("params", [(f"{names[id(p)]}/{key}", shape_of(names[id(p)], space.shapes[id(p)]),
                                t.dtype) for space, tensors in per_space for key, t in tensors.items()
                               for p in space.params if owner[names[id(p)]] == me])
    for space, tensors in per_space:
        keys = list(tensors)
        for key in keys:  # the same order on every rank: param_values is collective
            for p, value in relayout.param_values(space, tensors[key], topo):
                name = names[id(p)]
                # collective over the tensor-parallel ranks for a split parameter
                view = whole(name, value)
                if owner[name] == me:
                    out[f"{name}/{key}"] = buffers.copy(f"{name}/{key}", view)
                if key == "master" and owner[name] is not None:
                    index.append({"name": name, "shape": list(view.shape), "rank": owner[name], "keys": keys})
    buffers.ready()
    if split is not None:
        index = merge_index(split.from_stages(index))
    return out, index


def snapshot_module_extras(ts: TrainState, buffers: HostBuffers) -> Tuple[Tensors, dict]:
    """Rank 0's persistent buffers and frozen parameters, and how to rebuild the state_dict keys.

    Returns (tensors, layout) with layout = {"state_dict_keys": [...], "aliases": {tied name:
    first name}, "buffers": [...]}: the offline export emits exactly `module.state_dict()`'s keys.
    """
    module, first = ts.module, param_names(ts)
    aliases = {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
               if first[id(p)] != n}
    keys = list(module.state_dict(keep_vars=True).keys())
    param_keys = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    trained = {first[id(p)] for s in ts.spaces for p in s.params}
    extras: Tensors = {}
    for name, p in module.named_parameters():
        if name not in trained:  # frozen: outside the flat spaces
            extras[name] = buffers.copy(f"extra:{name}", p.detach())
    buffer_names = [name for name in keys if name not in param_keys]  # persistent buffers
    for name in buffer_names:
        extras[name] = buffers.copy(f"extra:{name}", module.get_buffer(name).detach())
    buffers.ready()
    return extras, {"state_dict_keys": keys, "aliases": aliases, "buffers": buffer_names}


def snapshot_split_extras(ts: TrainState, buffers: HostBuffers) -> Tuple[Tensors, dict]:
    """snapshot_module_extras of every stage, merged on rank 0 (collective over the stages)."""
    split = ts.split
    trained = {id(p) for s in ts.spaces for p in s.params}
    for name, p in ts.module.named_parameters():
        if id(p) not in trained and name in split.placements and split.tp > 1:
            raise CheckpointError(f"frozen parameter {name!r} is split by tensor parallelism: "
                                  "not supported in checkpoints; leave it out of the tp_plan")
    stages = split.from_stages(snapshot_module_extras(ts, buffers))
    extras = {k: v for part, _ in stages for k, v in part.items()}
    return extras, merge_layouts([layout for _, layout in stages])


# ---- scalars, RNG, data position -------------------------------------------------------------
def json_scalar(value: Any) -> Any:
    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    return value


def from_json_scalar(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]), device=device)
    return value


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def data_source(ts: TrainState) -> Tuple[Optional[str], Any]:
    """('loader' | 'sampler' | 'batch_sampler', object) holding the data position, or (None, None).

    Duck-typed: the first of the engine's training_dataloader, its sampler, its batch_sampler
    with both state_dict() and load_state_dict().
    """
    loader = ts.data_loader
    if loader is None:
        return None, None
    for where, obj in (("loader", loader), ("sampler", getattr(loader, "sampler", None)),
                       ("batch_sampler", getattr(loader, "batch_sampler", None))):
        if obj is not None and _stateful(obj):
            return where, obj
    return None, None


def data_state(ts: TrainState) -> Optional[dict]:
    """The data position, JSON-checked. Rank 0's: the position is global (a sampler resumable by
    global sample index gives every rank its share of the next batch from it)."""
    where, obj = data_source(ts)
    if obj is None:
        return None
    state = obj.state_dict()
    try:
        cio.json_bytes(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"training_dataloader {where}.state_dict() must be JSON-serialisable "
                              f"to be checkpointed: {e}") from None
    return {"source": where, "state": state}


def restore_data_state(ts: TrainState, saved: Optional[dict]) -> None:
    if saved is None:
        return
    where, obj = data_source(ts)
    if obj is None or where != saved["source"]:
        ts.log(f"checkpoint holds a data position (from the {saved['source']}) but the engine's "
               f"training_dataloader has no such state_dict(): data position not restored",
               logging.WARNING)
        return
    obj.load_state_dict(saved["state"])


_META_TYPES = {"world_size": int, "zero_stage": int, "counters": dict, "loss_scaler": dict,
               "lr_scheduler": (dict, type(None)), "optimizer_scalars": dict, "client_state": dict,
               "params": list}


def meta_problem(meta: dict) -> Optional[str]:
    """What in a parsed meta.json a load could not use, None if nothing: checked before anything
    is applied, so a bad file leaves the engine as it was."""
    for key, kind in _META_TYPES.items():
        if key not in meta:
            return f"it has no {key!r}"
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            return f"{key!r} is a {type(meta[key]).__name__}"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in meta["counters"].values()):
        return "'counters' holds a value that is not a whole number"
    if not all(isinstance(p, dict) and isinstance(p.get("shape"), list) and
               all(isinstance(d, int) for d in p["shape"]) for p in meta["params"]):
        return "'params' holds an entry without a shape"
    return None


def writers(ts: TrainState) -> int:
    """The ranks that write a checkpoint's files (and own its RNG states)."""
    return ts.topology.world_size if ts.split is None else ts.split.world


def layout_of(ts: TrainState) -> Dict[str, int]:
    return {"tp": 1, "pp": 1, "dp": ts.topology.world_size} if ts.split is None else ts.split.layout


def meta(ts: TrainState, tag: str, client_state: dict, index: List[dict], layout: dict) -> dict:
    """Everything rank 0 saves as JSON: run description, counters, small states."""
    scalars = relayout.scalar_state(ts.optimizer, ts.masters)
    scheduler = ts.lr_scheduler
    return {
        "format": cread.FORMAT, "tag": tag, "world_size": writers(ts), "layout": layout_of(ts),
        "zero_stage": ts.config.zero_optimization.stage, "precision": ts.precision,
        "config": ts.config.to_dict(),
        "counters": dataclasses.asdict(ts.counters),
        "loss_scaler": ts.loss_scaler.state_dict(),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None and
        hasattr(scheduler, "state_dict") else None,
        "optimizer_scalars": {k: json_scalar(v) for k, v in scalars.items()},
        "client_state": client_state, "params": index, "data": data_state(ts),
        "module": layout, "compression": compression_position(ts.compressor),
    }


def compression_position(compressor: Any) -> Optional[dict]:
    """Where a compressor's warm-up stands (1-bit: whether Adam's variance is frozen). Its
    error-feedback residuals are per rank and layout: a resume starts them afresh."""
    return None if compressor is None else {"kind": type(compressor).__name__, "step": compressor.step}


# ---- load --------------------------------------------------------------------------------------
def _param_state(ts: TrainState, saved: Tensors, optimizer_states: bool) -> relayout.ParamState:
    names, split = param_names(ts), ts.split
    shape_of = (lambda n, shape: shape) if split is None else split.full_shape
    mine = (lambda n, t: t) if split is None else split.shard  # this rank's shard of a whole tensor
    keys_of: Dict[str, set] = {}
    for key in saved:
        name, _, what = key.rpartition("/")
        keys_of.setdefault(name, set()).add(what)
    state: relayout.ParamState = {}
    for space in ts.spaces:
        for p in space.params:
            name = names[id(p)]
            keys = ["master"] + (sorted(keys_of.get(name, set()) - {"master"}) if optimizer_states else [])
            if f"{name}/master" not in saved:
                raise CheckpointError(f"checkpoint has no parameter {name!r}")
            got, want = tuple(saved[f"{name}/master"].shape), tuple(shape_of(name, space.shapes[id(p)]))
            if got != want:
                raise CheckpointError(f"parameter {name!r}: checkpoint shape {got}, model {want}")
            state[id(p)] = {k: mine(name, saved[f"{name}/{k}"]) for k in keys}
    return state


def _restore_module_extras(ts: TrainState, extras: Tensors) -> None:
    """Frozen parameters and persistent buffers, where the model has them at the same shape
    (a stage of a split model holds only its own)."""
    module = ts.module
    targets = dict(module.named_parameters())
    targets.update(dict(module.named_buffers()))
    with torch.no_grad():
        for name, value in extras.items():
            target = targets.get(name)
            if target is None and ts.split is not None:
                continue
            if target is None or target.shape != value.shape:
                raise CheckpointError(f"module tensor {name!r}: checkpoint shape {tuple(value.shape)}, "
                                      f"model {None if target is None else tuple(target.shape)}")
            target.copy_(value)


def apply(ts: TrainState, saved: Tensors, extras: Tensors, rng: Optional[bytes], meta: dict,
          optimizer_states: bool, scheduler_state: bool, module_only: bool,
          shards: Optional[List[Tensors]] = None) -> None:
    """Put a checkpoint's state into a (possibly differently laid out) engine: whole parameters
    (`saved`), or this rank's shards already in the engine's layout (`shards`)."""
    scalars = {}
    if optimizer_states:
        device = ts.master_device
        scalars = {k: from_json_scalar(v, device) for k, v in meta["optimizer_scalars"].items()}
    if shards is not None:
        relayout.import_shards(ts.masters, ts.optimizer, shards, scalars)
    else:
        relayout.import_state(ts.spaces, ts.masters, ts.optimizer, _param_state(ts, saved, optimizer_states), scalars)
    ts.write_back()  # the model's parameters from the loaded masters
    _restore_module_extras(ts, extras)
    if module_only:
        return
    ts.loss_scaler.load_state_dict(meta["loss_scaler"])
    if scheduler_state and meta["lr_scheduler"] is not None and ts.lr_scheduler is not None:
        ts.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    for key, value in meta["counters"].items():
        setattr(ts.counters, key, value)
    restore_data_state(ts, meta.get("data"))
    saved_position = meta.get("compression")
    if ts.compressor is not None and saved_position and saved_position["kind"] == type(ts.compressor).__name__:
        ts.compressor.step = int(saved_position["step"])
    same = meta["world_size"] == writers(ts) and meta.get("layout", layout_of(ts)) == layout_of(ts)
    if same and rng is not None:
        set_rng_state(cio.json_from_bytes(rng))
    elif not same:
        ts.log(f"checkpoint saved by {meta['world_size']} rank(s) laid out as {meta.get('layout')}, "
               f"loaded by {writers(ts)} as {layout_of(ts)}: RNG states not restored")
