"""Checkpoints that load at any world size and ZeRO stage, survive crashes, save asynchronously.

Layout of one checkpoint, `<root>/<tag>/`:

    meta.json                       rank 0: format, tag, world size, ZeRO stage, precision, config,
                                    counters, loss-scaler and LR-scheduler state, optimizer scalar
                                    state (Adam's step), client_state, data position, parameter
                                    index, the module's state_dict keys and tied names
    params-rank00001-00000.pt       rank r, in parts of at most 1 GiB: fp32 master + per-element
                                    optimizer state ("<name>/master", "<name>/exp_avg", ...) of
                                    the parameters a round-robin over names assigns to r
                                    (.safetensors when that package is installed)
    module-extras-00000.pt          rank 0: persistent buffers and frozen parameters
    rng-rank00001.json              rank r: its RNG states (torch, cuda, python, numpy)
    manifest.json                   rank 0, last: sha256 and size of every other file

A save has two halves. The snapshot (state.py, on the training thread, collective)
all-gathers the state one flat space at a time and copies this rank's share into host memory.
The write and commit (write.py, no collective) serialise, checksum and write the files
into `<tag>.tmp-<token>/`; rank 0 commits with the manifest, a directory move and the `latest`
pointer, then applies retention (retention.py). With `async_save` the second half runs
on a background thread and training is blocked only for the snapshot; the next save, a load,
`wait_checkpoint()` and `close()` wait for it, and its error surfaces there.

Loading (rank 0 chooses and verifies, read.py) reads every file on every rank and
imports it with `relayout.import_state`, so the loader's world size and stage may differ from the
saver's. RNG states are restored only at an equal world size (rank r gets rank r's).
"""
from __future__ import annotations

import secrets
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import storage as cio
from . import read as cread
from . import state as cstate
from . import write as cwrite
from .storage import CheckpointError

Tensors = Dict[str, torch.Tensor]

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "wait_checkpoint"]
FORMAT, LATEST = cread.FORMAT, cread.LATEST


# ---- collectives (no-ops on one rank) -----------------------------------------------------
def _distributed(engine) -> bool:
    return engine.topology.world_size > 1 and dist.is_initialized()


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


def _saver(engine) -> cwrite.BackgroundSaver:
    if getattr(engine, "_checkpoint_saver", None) is None:
        engine._checkpoint_saver = cwrite.BackgroundSaver()
    return engine._checkpoint_saver


def _settle_previous(engine) -> None:
    """Collective: wait for this rank's save in flight; every rank raises if any rank's failed."""
    error = None
    try:
        wait_checkpoint(engine)
    except CheckpointError as e:
        error = f"the previous asynchronous save failed: {e}"
    _agree(engine, error)


def wait_checkpoint(engine) -> Optional[str]:
    """Block until this rank's save in flight is committed; its path, or None if none was in
    flight. Raises its CheckpointError (once). Not collective."""
    saver = getattr(engine, "_checkpoint_saver", None)
    return None if saver is None else saver.wait()


# ---- save -------------------------------------------------------------------------------------
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


def _check_tag(engine, tag: Optional[str]) -> str:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag == LATEST or cread.STAGING in tag:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")
    return tag


def _snapshot(engine, job: cwrite.SaveJob, client_state: dict, buffers: cstate.HostBuffers) -> None:
    """Fill the job with this rank's share of the state, on the host (collective)."""
    rank = engine.topology.rank
    tensors, index = cstate.snapshot_params(engine, buffers)
    job.tensor_files.update(cwrite.split_parts(f"{cread.PARAMS}{rank:05d}", tensors))
    job.byte_files[f"rng-rank{rank:05d}.json"] = cio.json_bytes(cstate.rng_state(), compact=True)
    if rank == 0:
        extras, layout = cstate.snapshot_module_extras(engine, buffers)
        if extras:
            job.tensor_files.update(cwrite.split_parts(cread.EXTRAS, extras))
        job.byte_files[cread.META] = cio.json_bytes(cstate.meta(engine, job.tag, client_state, index, layout))


def save_checkpoint(engine, path_or_uri: str, tag: Optional[str] = None,
                    client_state: Optional[dict] = None, async_save: Optional[bool] = None) -> str:
    """Write a checkpoint; every rank calls it. Returns the checkpoint's path (with async_save,
    the path it will have once committed: `wait_checkpoint()` says when)."""
    client_state = _check_client_state(client_state)
    tag = _check_tag(engine, tag)
    settings = engine.config.checkpoint
    async_save = settings.async_save if async_save is None else bool(async_save)
    _settle_previous(engine)
    engine.finish_delayed_update()
    topo, saver = engine.topology, _saver(engine)
    fs, root = cio.filesystem(path_or_uri)
    job = cwrite.SaveJob(fs, root, tag, _broadcast(engine, secrets.token_hex(4)), topo.rank,
                         topo.world_size, engine.global_steps, settings)
    error = None
    try:
        if topo.rank == 0:
            fs.create_dir(job.staging, recursive=True)
    except OSError as e:
        error = f"cannot create checkpoint directory {job.staging}: {e}"
    _agree(engine, error)
    if async_save and saver.buffers is None:
        saver.buffers = cstate.HostBuffers(pin=engine.topology.device.type == "cuda")
    buffers = saver.buffers if async_save else cstate.HostBuffers(pin=False)
    try:
        _snapshot(engine, job, client_state, buffers)
    except CheckpointError as e:  # e.g. a data position that is not JSON, on rank 0
        error = f"rank {topo.rank}: {e}"
    _agree(engine, error)
    if async_save:
        saver.submit(job)
        return job.final
    try:
        cwrite.run(job)
    except Exception as e:  # noqa: BLE001 - every rank must raise together
        error = str(e) if isinstance(e, CheckpointError) else f"rank {topo.rank}: {type(e).__name__}: {e}"
    _agree(engine, error)
    engine._log(f"saved checkpoint {job.final}")
    return job.final


# ---- load -------------------------------------------------------------------------------------
def _read_state(fs, ckpt: str, rank: int) -> Tuple[dict, Tensors, Tensors, Optional[bytes]]:
    """(meta, parameter tensors, module extras, this rank's RNG bytes), every file verified."""
    manifest, small = cread.read_json_files(fs, ckpt)
    saved: Tensors = {}
    extras: Tensors = {}
    tensor_names = [n for n in sorted(manifest["files"]) if not n.endswith(".json")]
    for name, data in cread.iter_verified(fs, ckpt, manifest, tensor_names):
        target = extras if name.startswith(cread.EXTRAS) else saved
        target.update(cio.tensors_from_bytes(data, name))
    return cio.json_from_bytes(small[cread.META]), saved, extras, small.get(f"rng-rank{rank:05d}.json")


def load_checkpoint(engine, path_or_uri: str, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> Tuple[Optional[str], Optional[dict]]:
    """Load a checkpoint saved at any world size/stage; every rank calls it.

    Returns (checkpoint path, rank 0's client_state), or (None, None) when there is none.
    """
    _settle_previous(engine)
    fs, root = cio.filesystem(path_or_uri)
    chosen, error = None, None
    if engine.topology.rank == 0:
        try:
            chosen = cread.choose(fs, root, tag)
        except CheckpointError as e:
            error = str(e)
        except (OSError, ValueError, KeyError, TypeError) as e:  # reported to every rank, no hang
            error = f"reading checkpoints under {root}: {type(e).__name__}: {e}"
    chosen, error = _broadcast(engine, (chosen, error))
    if error:
        raise CheckpointError(error)
    if chosen is None:
        return None, None
    ckpt = cio.join(root, chosen)
    error, meta = None, {}
    try:
        meta, saved, extras, rng = _read_state(fs, ckpt, engine.topology.rank)
        optimizer = load_optimizer_states and not load_module_only
        scheduler = load_lr_scheduler_states and not load_module_only
        cstate.apply(engine, saved, extras, rng, meta, optimizer, scheduler, load_module_only)
    except (CheckpointError, KeyError, ValueError, RuntimeError, OSError) as e:
        # every rank learns of a failure on any rank (none is left waiting in a collective)
        kind = "" if isinstance(e, CheckpointError) else f"{type(e).__name__}: "
        error = f"rank {engine.topology.rank}: loading {ckpt}: {kind}{e}"
    _agree(engine, error)
    engine._log(f"loaded checkpoint {ckpt} (saved by {meta['world_size']} rank(s), "
                f"ZeRO stage {meta['zero_stage']})")
    return ckpt, meta["client_state"]
