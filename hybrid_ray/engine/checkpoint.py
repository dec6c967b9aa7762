"""Checkpoints that load at any world size and ZeRO stage (issue 4, first slice).

Layout of one checkpoint, `<root>/<tag>/`:

    meta.json                 rank 0: format, tag, world size, ZeRO stage, precision, config,
                              counters, loss-scaler and LR-scheduler state, optimizer scalar
                              state (Adam's step), client_state, the parameter list
    params-rank00001.pt       rank r: fp32 master + per-element optimizer state ("<name>/master",
                              "<name>/exp_avg", ...) of the parameters assigned to r by a
                              round-robin over parameter names (.safetensors when installed)
    rng-rank00001.json        rank r: its RNG states (torch, cuda, python, numpy)
    manifest.json             rank 0, last: sha256 and size of every other file

Writing: every rank writes into `<root>/<tag>.tmp-<random>`; after a barrier rank 0 writes the
manifest, moves the staging directory to `<tag>` (replacing an older one; on stores that cannot
move directories, such as S3, the files are copied with the manifest last) and rewrites
`<root>/latest` (temp file + move). A checkpoint without a manifest is never loaded.

The per-parameter state is gathered space by space (one all-gather per bucket per state
tensor, on every rank: each rank holds at most one space's state in full at a time, plus the
parameters it owns on the host). Loading reads every file on every rank (the new layout's
shards are cut from whole parameters) and imports them with `relayout.import_state`, so the
loader's world size and stage may differ from the saver's. RNG states are restored only at an
equal world size (rank r gets rank r's). Parameters outside the engine's flat spaces (frozen,
not trained) are not saved: they come from the model's construction.
"""
from __future__ import annotations

import logging
import random
import secrets
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import checkpoint_io as cio
from . import relayout

log = logging.getLogger("hybrid_ray")
FORMAT = "hybrid_ray.checkpoint/1"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded (corrupt, incomplete, incompatible)."""


# ---- collectives (no-ops on one rank) -----------------------------------------------------
def _distributed(engine) -> bool:
    return engine.topology.world_size > 1 and dist.is_initialized()


def _barrier(engine) -> None:
    if _distributed(engine):
        dist.barrier(group=engine.topology.group)


def _broadcast(engine, obj: Any) -> Any:
    if not _distributed(engine):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=engine.topology.group)
    return box[0]


def _gather(engine, obj: Any) -> List[Any]:
    if not _distributed(engine):
        return [obj]
    out: List[Any] = [None] * engine.topology.world_size
    dist.all_gather_object(out, obj, group=engine.topology.group)
    return out


def _agree(engine, error: Optional[str]) -> None:
    """Raise the same CheckpointError on every rank if any rank failed (no rank left hanging)."""
    errors = [e for e in _gather(engine, error) if e]
    if errors:
        raise CheckpointError(errors[0])


# ---- what is saved --------------------------------------------------------------------------
def _param_names(engine) -> Dict[int, str]:
    """id(param) -> name, tied parameters once under their first name."""
    return {id(p): n for n, p in engine.module.named_parameters()}


def _owner(index: int, world: int) -> int:
    return index % world


def _per_element_keys(engine, master: torch.Tensor) -> List[str]:
    state = engine.optimizer.state.get(master, {})
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape)


def _local_param_state(engine) -> Tuple[Dict[str, torch.Tensor], List[dict]]:
    """This rank's share of the per-parameter state, gathered space by space; and the index."""
    topo, names = engine.topology, _param_names(engine)
    ordered = sorted(names[id(p)] for s in engine.spaces for p in s.params)
    owner = {n: _owner(i, topo.world_size) for i, n in enumerate(ordered)}
    out: Dict[str, torch.Tensor] = {}
    index: List[dict] = []
    for space, master in zip(engine.spaces, engine.zero.masters):
        keys = ["master"] + _per_element_keys(engine, master)
        tensors = {"master": master.detach()}
        tensors.update({k: engine.optimizer.state[master][k] for k in keys[1:]})
        for key in keys:
            full = relayout.full_flat(space, tensors[key], topo)
            for p, off in space.param_offsets():
                name, shape = names[id(p)], space.shapes[id(p)]
                if owner[name] == topo.rank:
                    out[f"{name}/{key}"] = full[off:off + shape.numel()].view(shape).to("cpu", copy=True)
                if key == "master":
                    index.append({"name": name, "shape": list(shape), "rank": owner[name], "keys": keys})
            del full
    return out, index


def _json_scalar(value: Any) -> Any:
    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    return value


def _from_json_scalar(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]), device=device)
    return value


def _rng_state() -> dict:
    state: Dict[str, Any] = {"torch": torch.get_rng_state().tolist()}
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _check_client_state(client_state: Any) -> dict:
    client_state = {} if client_state is None else client_state
    if not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    try:
        cio.json_bytes(client_state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"client_state must be JSON-serialisable (str/int/float/bool/None, "
                              f"lists and dicts with str keys): {e}") from None
    return client_state


# ---- save -------------------------------------------------------------------------------------
def save_checkpoint(engine, path_or_uri: str, tag: Optional[str] = None,
                    client_state: Optional[dict] = None) -> str:
    """Write a checkpoint; every rank calls it. Returns the checkpoint's path."""
    client_state = _check_client_state(client_state)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag == LATEST or ".tmp-" in tag:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")
    engine.finish_delayed_update()
    topo = engine.topology
    fs, root = cio.filesystem(path_or_uri)
    staging = _broadcast(engine, cio.join(root, f"{tag}.tmp-{secrets.token_hex(4)}"))
    error = None
    if topo.rank == 0:
        try:
            fs.create_dir(staging, recursive=True)
        except OSError as e:
            error = f"cannot create checkpoint directory {staging}: {e}"
    _agree(engine, error)

    tensors, index = _local_param_state(engine)
    files: Dict[str, bytes] = {
        f"params-rank{topo.rank:05d}{cio.TENSOR_EXT}": cio.tensors_to_bytes(tensors),
        f"rng-rank{topo.rank:05d}.json": cio.json_bytes(_rng_state()),
    }
    if topo.rank == 0:
        files["meta.json"] = cio.json_bytes(_meta(engine, tag, client_state, index))
    entries, error = {}, None
    try:
        for name, data in files.items():
            cio.write_bytes(fs, cio.join(staging, name), data)
            digest, size = cio.manifest_entry(data)
            entries[name] = {"sha256": digest, "bytes": size}
    except OSError as e:
        error = f"rank {topo.rank}: writing checkpoint {staging}: {e}"
    all_entries = _gather(engine, entries)
    _agree(engine, error)
    final = cio.join(root, tag)
    if topo.rank == 0:
        try:
            manifest = {"format": FORMAT, "tag": tag, "global_steps": engine.global_steps,
                        "files": {k: v for e in all_entries for k, v in e.items()}}
            cio.write_bytes(fs, cio.join(staging, "manifest.json"), cio.json_bytes(manifest))
            if cio.exists(fs, final):
                fs.delete_dir(final)
            cio.move_dir(fs, staging, final)
            tmp = cio.join(root, f"{LATEST}.tmp-{secrets.token_hex(4)}")
            cio.write_bytes(fs, tmp, tag.encode())
            fs.move(tmp, cio.join(root, LATEST))
        except OSError as e:
            error = f"finishing checkpoint {final}: {e}"
    _agree(engine, error)
    engine._log(f"saved checkpoint {final}")
    return final


def _meta(engine, tag: str, client_state: dict, index: List[dict]) -> dict:
    scalars = relayout.scalar_state(engine.optimizer, engine.zero.masters)
    scheduler = engine.lr_scheduler
    return {
        "format": FORMAT, "tag": tag, "world_size": engine.topology.world_size,
        "zero_stage": engine.config.zero_optimization.stage, "precision": engine.base_dtype,
        "config": engine.config.to_dict(),
        "counters": {k: getattr(engine, k) for k in
                     ("global_steps", "skipped_steps", "micro_steps", "global_samples")},
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None and
        hasattr(scheduler, "state_dict") else None,
        "optimizer_scalars": {k: _json_scalar(v) for k, v in scalars.items()},
        "client_state": client_state, "params": index,
    }


# ---- load -------------------------------------------------------------------------------------
def _read_verified(fs, ckpt: str) -> Dict[str, bytes]:
    """Every file of a checkpoint, checked against its manifest; CheckpointError if not good."""
    try:
        manifest = cio.json_from_bytes(cio.read_bytes(fs, cio.join(ckpt, "manifest.json")))
    except (OSError, FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete or corrupt: manifest.json: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt}: unknown format {manifest.get('format')!r}")
    out = {}
    for name, entry in manifest["files"].items():
        try:
            data = cio.read_bytes(fs, cio.join(ckpt, name))
        except (OSError, FileNotFoundError) as e:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} is missing ({e})") from None
        if len(data) != entry["bytes"] or cio.sha256(data) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} fails its sha256 check "
                                  f"({len(data)} bytes, manifest says {entry['bytes']})")
        out[name] = data
    return out


def _candidates(fs, root: str) -> List[str]:
    """Complete checkpoints under root, newest (by saved global_steps) first."""
    found = []
    for name in cio.list_dirs(fs, root):
        if ".tmp-" in name:
            continue
        try:
            m = cio.json_from_bytes(cio.read_bytes(fs, cio.join(root, name, "manifest.json")))
            found.append((int(m.get("global_steps", -1)), name))
        except (OSError, FileNotFoundError, ValueError):
            continue
    return [name for _, name in sorted(found, reverse=True)]


def _choose(engine, fs, root: str, tag: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """(tag to load or None, error): decided on rank 0, which verifies checksums."""
    if tag is not None:
        ckpt = cio.join(root, str(tag))
        if not cio.is_dir(fs, ckpt):
            log.warning("no checkpoint %s: nothing loaded", ckpt)
            return None, None
        try:
            _read_verified(fs, ckpt)
            return str(tag), None
        except CheckpointError as e:
            return None, str(e)
    latest = cio.read_text(fs, cio.join(root, LATEST))
    order = _candidates(fs, root)
    if latest is not None:
        order = [latest] + [t for t in order if t != latest]
    for i, name in enumerate(order):
        try:
            _read_verified(fs, cio.join(root, name))
        except CheckpointError as e:
            log.warning("%s; trying an older checkpoint", e)
            continue
        if i > 0:
            log.warning("loading checkpoint %s instead of %s (latest)", name, order[0])
        return name, None
    if order:
        return None, f"no loadable checkpoint under {root}: every candidate is corrupt ({', '.join(order)})"
    return None, None


def load_checkpoint(engine, path_or_uri: str, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> Tuple[Optional[str], Optional[dict]]:
    """Load a checkpoint saved at any world size/stage; every rank calls it.

    Returns (checkpoint path, rank 0's client_state), or (None, None) when there is none.
    """
    fs, root = cio.filesystem(path_or_uri)
    chosen, error = (None, None)
    if engine.topology.rank == 0:
        try:
            chosen, error = _choose(engine, fs, root, tag)
        except (OSError, ValueError, KeyError, TypeError) as e:  # reported to every rank, no hang
            error = f"reading checkpoints under {root}: {type(e).__name__}: {e}"
    chosen, error = _broadcast(engine, (chosen, error))
    if error:
        raise CheckpointError(error)
    if chosen is None:
        return None, None
    ckpt = cio.join(root, chosen)
    error = None
    try:
        files = _read_verified(fs, ckpt)
        meta = cio.json_from_bytes(files["meta.json"])
        _apply(engine, files, meta, load_optimizer_states and not load_module_only,
               load_lr_scheduler_states and not load_module_only, load_module_only)
    except (CheckpointError, KeyError, ValueError, RuntimeError, OSError) as e:
        # every rank learns of a failure on any rank (none is left waiting in a collective)
        kind = "" if isinstance(e, CheckpointError) else f"{type(e).__name__}: "
        error = f"rank {engine.topology.rank}: loading {ckpt}: {kind}{e}"
    _agree(engine, error)
    engine._log(f"loaded checkpoint {ckpt} (saved by {meta['world_size']} rank(s), "
                f"ZeRO stage {meta['zero_stage']})")
    return ckpt, meta["client_state"]


def _apply(engine, files: Dict[str, bytes], meta: dict, optimizer_states: bool,
           scheduler_state: bool, module_only: bool) -> None:
    saved: Dict[str, torch.Tensor] = {}
    for name, data in files.items():
        if name.startswith("params-rank"):
            saved.update(cio.tensors_from_bytes(data, name))
    names = _param_names(engine)
    keys_of: Dict[str, set] = {}
    for key in saved:
        name, _, what = key.rpartition("/")
        keys_of.setdefault(name, set()).add(what)
    state: relayout.ParamState = {}
    for space in engine.spaces:
        for p in space.params:
            name = names[id(p)]
            keys = ["master"] + (sorted(keys_of.get(name, set()) - {"master"}) if optimizer_states else [])
            if f"{name}/master" not in saved:
                raise CheckpointError(f"checkpoint has no parameter {name!r}")
            if tuple(saved[f"{name}/master"].shape) != tuple(space.shapes[id(p)]):
                raise CheckpointError(f"parameter {name!r}: checkpoint shape "
                                      f"{tuple(saved[f'{name}/master'].shape)}, model {tuple(space.shapes[id(p)])}")
            state[id(p)] = {k: saved[f"{name}/{k}"] for k in keys}
    scalars = {}
    if optimizer_states:
        device = engine.zero.master_device
        scalars = {k: _from_json_scalar(v, device) for k, v in meta["optimizer_scalars"].items()}
    relayout.import_state(engine.spaces, engine.zero.masters, engine.optimizer, state, scalars)
    engine.zero.write_back()  # the model's parameters from the loaded masters
    if module_only:
        return
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if scheduler_state and meta["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    for key, value in meta["counters"].items():
        setattr(engine, key, value)
    if meta["world_size"] == engine.topology.world_size:
        rng = files.get(f"rng-rank{engine.topology.rank:05d}.json")
        if rng is not None:
            _set_rng_state(cio.json_from_bytes(rng))
    else:
        engine._log(f"checkpoint saved by {meta['world_size']} rank(s), loaded by "
                    f"{engine.topology.world_size}: RNG states not restored")
