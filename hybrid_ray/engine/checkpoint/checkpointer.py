"""The Checkpointer, an engine's saves and loads, and the layout of one checkpoint on storage.

Layout of one checkpoint, `<root>/<tag>/`:

    meta.json                       rank 0: format, tag, world size, ZeRO stage, precision, config,
                                    counters, loss-scaler and LR-scheduler state, optimizer scalar
                                    state (Adam's step), client_state, data position, parameter
                                    index, the module's state_dict keys and tied names
    params-rank00001-00000.pt       rank r, in parts of at most 1 GiB: fp32 master + per-element
                                    optimizer state ("<name>/master", "<name>/exp_avg", ...) of
                                    the parameters `state.owners` assigns to r (by size)
                                    (.safetensors when that package is installed)
    module-extras-00000.pt          rank 0: persistent buffers and frozen parameters
    rng-rank00001.json              rank r: its RNG states (torch, cuda, python, numpy)
    manifest.json                   rank 0, last: sha256 and size of every other file

`Checkpointer` is an engine's save/load face: it owns the background saver and the cancel handle
that ends its commit waits when the group is torn down. A save has two halves. The snapshot (state.py, on the training thread, collective)
all-gathers the state one flat space at a time and copies this rank's share into host memory.
The write and commit (write.py, no collective) serialise, checksum and write the files
into `<tag>.tmp-<token>/`; rank 0 commits with the manifest, a directory move and the `latest`
pointer, then applies retention (retention.py). With `async_save` the second half runs
on a background thread and training is blocked only for the snapshot; the next save, a load,
`wait_checkpoint()` and `close()` wait for it, and its error surfaces there.

Loading (rank 0 chooses from manifests and file sizes, read.py) reads every file on every rank,
checking its sha256 as it reads it (a candidate that fails is passed over for the next), and
imports it with `relayout.import_state`, so the loader's world size and stage may differ from the
saver's. RNG states are restored only at an equal world size (rank r gets rank r's).
"""
from __future__ import annotations

import logging
import secrets
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..topology import Topology
from . import client_state as cclient
from . import read as cread
from . import state as cstate
from . import storage as cio
from . import write as cwrite
from .liveness import Heartbeat, group_store
from .state import TrainState
from .storage import CheckpointError

Tensors = Dict[str, torch.Tensor]


def check_tag(tag: Optional[str], global_steps: int) -> str:
    tag = str(tag) if tag is not None else f"global_step{global_steps}"
    if not tag or "/" in tag or tag == cread.LATEST or cread.STAGING in tag:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}")
    return tag


def _read_state(fs, ckpt: str, rank: int) -> Tuple[dict, Tensors, Tensors, Optional[bytes]]:
    """(meta, parameter tensors, module extras, this rank's RNG bytes), every file verified."""
    manifest, small = cread.read_json_files(fs, ckpt)
    saved: Tensors = {}
    extras: Tensors = {}
    tensor_names = [n for n in sorted(manifest["files"]) if not n.endswith(".json") and n != cclient.FILE]
    for name, data in cread.iter_verified(fs, ckpt, manifest, tensor_names):
        target = extras if name.startswith(cread.EXTRAS) else saved
        target.update(cread.parse_tensors(data, ckpt, name))
    meta = cread.parse_json(small[cread.META], ckpt, cread.META)
    problem = cstate.meta_problem(meta)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {cread.META}: {problem}")
    if cclient.FILE in manifest["files"]:  # a client_state JSON could not hold
        for _, data in cread.iter_verified(fs, ckpt, manifest, [cclient.FILE]):
            meta["client_state"] = cclient.parse(data, ckpt)
    rng_name = f"rng-rank{rank:05d}.json"
    rng = small.get(rng_name)
    if rng is not None:
        problem = cstate.rng_problem(cread.parse_json(rng, ckpt, rng_name))
        if problem:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {rng_name}: {problem}")
    return meta, saved, extras, rng


def _load_failure(rank: int, ckpt: str, e: Exception) -> str:
    """One line for a load that failed past the checksums: a file that parsed but does not hold
    what this engine needs (a missing entry, another model's shapes)."""
    if isinstance(e, CheckpointError):
        what = str(e)
    elif isinstance(e, KeyError):
        what = f"{cread.META} or a tensor file lacks the entry {e.args[0]!r} (KeyError)"
    else:
        what = f"{type(e).__name__}: {str(e)[:300]}"
    return f"rank {rank}: loading {ckpt}: {what}"


class Checkpointer:
    """The checkpoints of one engine. Every method but `wait` and `cancel` is collective.

    train_state: builds the engine's TrainState at the moment of a save or load.
    settle: lands work in flight on the parameters first (a delayed offload update).
    cancel: set when the group is being torn down (Topology.abort): commit waits for the files
      of a peer that died end at once instead of after checkpoint.commit_timeout_s.
    """

    def __init__(self, topology: Topology, train_state: Callable[[], TrainState],
                 settle: Callable[[], None], log: Callable[..., None]):
        self.topology, self._train_state, self._settle, self._log = topology, train_state, settle, log
        self.cancel_event: threading.Event = topology.abort
        self._saver: Optional[cwrite.BackgroundSaver] = None

    # ---- collectives (no-ops on one rank) --------------------------------------------------
    def _distributed(self) -> bool:
        return self.topology.world_size > 1 and dist.is_initialized()

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group_src=0, group=self.topology.group)
        return box[0]

    def _errors(self, error: Optional[str]) -> List[str]:
        """Every rank's error, in rank order (collective)."""
        errors = [error]
        if self._distributed():
            errors = [None] * self.topology.world_size
            try:
                dist.all_gather_object(errors, error, group=self.topology.group)
            except Exception as e:  # noqa: BLE001 - the collective failed: a peer is gone
                lost = f"rank {self.topology.rank}: a peer left the group during a checkpoint " \
                       f"({type(e).__name__}: {str(e).splitlines()[0][:160]})"
                raise CheckpointError(error or lost) from None
        return [e for e in errors if e]

    def _agree(self, error: Optional[str]) -> None:
        """Raise the same CheckpointError on every rank if any rank failed (none left hanging)."""
        errors = self._errors(error)
        if errors:
            raise CheckpointError(errors[0])

    def _agree_on_place(self, path_or_uri: Any, tag: Any) -> Tuple[str, Optional[str]]:
        """Rank 0's directory and tag on every rank, before anything is written. Either computed
        per rank (a tag from the local loss, a directory named after the local clock) would
        otherwise send each rank's files elsewhere and leave the commit waiting for files that
        never come; a warning names who differed."""
        place = (str(path_or_uri), None if tag is None else str(tag))
        if not self._distributed():
            return place
        places: List[Tuple[str, Optional[str]]] = [place] * self.topology.world_size
        dist.all_gather_object(places, place, group=self.topology.group)
        for i, what in ((1, "tags"), (0, "directories")):
            differ = {r: p[i] for r, p in enumerate(places) if p[i] != places[0][i]}
            if differ and self.topology.rank == 0:
                self._log(f"checkpoint {what} differ between ranks: rank 0 has {places[0][i]!r}, "
                          + ", ".join(f"rank {r} {t!r}" for r, t in differ.items())
                          + f"; every rank saves under rank 0's", logging.WARNING)
        return places[0]

    # ---- the save in flight ------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """An asynchronous save is still being written or committed."""
        return self._saver is not None and self._saver.busy

    def wait(self) -> Optional[str]:
        """Block until this rank's save in flight is committed; its path, or None if none was in
        flight. Raises its CheckpointError (once). Not collective."""
        return None if self._saver is None else self._saver.wait()

    def cancel(self) -> None:
        """End this engine's commit waits now (and for the rest of its group's life)."""
        self.cancel_event.set()

    def _settle_previous(self) -> None:
        """Collective: wait for this rank's save in flight; every rank raises if any rank's failed."""
        error = None
        try:
            self.wait()
        except CheckpointError as e:
            error = f"the previous asynchronous save failed: {e}"
        self._agree(error)

    def close(self) -> None:
        """Wait for the save in flight (its error is raised), then drop the thread and buffers."""
        try:
            self.wait()
        finally:
            if self._saver is not None:
                self._saver.close()
                self._saver = None

    # ---- save -------------------------------------------------------------------------------
    def _snapshot(self, ts: TrainState, job: cwrite.SaveJob, client_state: Tuple[dict, Optional[bytes]],
                  buffers: cstate.HostBuffers) -> None:
        """Fill the job with this rank's share of the state, on the host (collective)."""
        rank = self.topology.rank
        # 1-bit momentum form: the saved momentum carries what the residuals still owe
        fold = getattr(ts.compressor, "fold_debt", None)  # a no-op until it has residuals
        undo = fold() if fold is not None else None
        try:
            tensors, index = cstate.snapshot_params(ts, buffers)
        finally:
            if undo is not None:
                undo()
        job.tensor_files.update(cwrite.split_parts(f"{cread.PARAMS}{rank:05d}", tensors))
        job.byte_files[f"rng-rank{rank:05d}.json"] = cio.json_bytes(cstate.rng_state(), compact=True)
        split = ts.split is not None  # every stage's extras reach rank 0 (collective)
        extras, layout = cstate.snapshot_split_extras(ts, buffers) if split else ({}, {})
        if rank == 0:
            if not split:
                extras, layout = cstate.snapshot_module_extras(ts, buffers)
            if extras:
                job.tensor_files.update(cwrite.split_parts(cread.EXTRAS, extras))
            in_meta, pt_file = client_state
            job.byte_files[cread.META] = cio.json_bytes(cstate.meta(ts, job.tag, in_meta, index, layout))
            if pt_file is not None:
                job.byte_files[cclient.FILE] = pt_file

    def _start(self, path_or_uri: str, tag: str, ts: TrainState) -> cwrite.SaveJob:
        """The save's job, with its staging directory made by rank 0 (collective)."""
        topo = self.topology
        fs, root = cio.filesystem(path_or_uri)
        token = self._broadcast(secrets.token_hex(4))
        store = group_store() if topo.world_size > 1 else None
        heartbeat = None if store is None else Heartbeat(
            store, token, topo.rank, topo.world_size, ts.config.checkpoint.peer_timeout_s)
        job = cwrite.SaveJob(fs, root, tag, token, topo.rank, topo.world_size,
                             ts.counters.global_steps, ts.config.checkpoint,
                             cancel=self.cancel_event, heartbeat=heartbeat)
        error = None
        try:
            if topo.rank == 0:
                fs.create_dir(job.staging, recursive=True)
        except OSError as e:
            error = f"cannot create checkpoint directory {job.staging}: {e}"
        self._agree(error)
        return job

    def save(self, path_or_uri: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
             async_save: Optional[bool] = None) -> str:
        """Write a checkpoint; every rank calls it. Returns the checkpoint's path (with async_save,
        the path it will have once committed: `wait()` says when)."""
        prepared = cclient.prepare(client_state)  # every rank checks its own; rank 0's is saved
        ts = self._train_state()
        path_or_uri, tag = self._agree_on_place(path_or_uri, tag)
        tag = check_tag(tag, ts.counters.global_steps)
        self._settle_previous()
        self._settle()
        async_save = ts.config.checkpoint.async_save if async_save is None else bool(async_save)
        job = self._start(path_or_uri, tag, ts)
        if self._saver is None:
            self._saver = cwrite.BackgroundSaver()
        if async_save and self._saver.buffers is None:
            self._saver.buffers = cstate.HostBuffers(pin=self.topology.device.type == "cuda")
        buffers = self._saver.buffers if async_save else cstate.HostBuffers(pin=False)
        error = None
        try:
            self._snapshot(ts, job, prepared, buffers)
        except CheckpointError as e:  # e.g. a data position that is not JSON, on rank 0
            error = f"rank {self.topology.rank}: {e}"
        self._agree(error)
        if async_save:
            self._saver.submit(job)
            return job.final
        try:
            cwrite.run(job)
        except Exception as e:  # noqa: BLE001 - every rank must raise together
            error = str(e) if isinstance(e, CheckpointError) else \
                f"rank {self.topology.rank}: {type(e).__name__}: {e}"
        self._agree(error)
        self._log(f"saved checkpoint {job.final}")
        return job.final

    # ---- load -------------------------------------------------------------------------------
    def _choose(self, root: str, fs, tag: Optional[str], passed: Tuple[str, ...]) -> Optional[str]:
        """Rank 0 chooses and verifies; every rank gets its choice, or its error."""
        chosen, error = None, None
        if self.topology.rank == 0:
            try:
                chosen = cread.choose(fs, root, tag, passed, full=False)
            except CheckpointError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - reported to every rank, none left hanging
                error = f"reading checkpoints under {root}: {type(e).__name__}: {e}"
        chosen, error = self._broadcast((chosen, error))
        if error:
            raise CheckpointError(error)
        return chosen

    def _read_agreed(self, fs, root: str, tag: Optional[str]) -> Tuple[Optional[str], Any]:
        """(checkpoint path, what _read_state read) of the first candidate every rank can read:
        a file can pass its checksum and still not parse; without a tag the next one is tried."""
        passed: Tuple[str, ...] = ()
        failed: Optional[str] = None
        while True:
            chosen = self._choose(root, fs, tag, passed)
            if chosen is None:
                if failed is not None:  # every copy of the tag asked for failed to read
                    raise CheckpointError(failed)
                return None, None
            ckpt, error, got = cio.join(root, chosen), None, None
            try:
                got = _read_state(fs, ckpt, self.topology.rank)  # each file's sha256 checked here
            except Exception as e:  # noqa: BLE001 - every rank learns of a failure on any rank
                error = _load_failure(self.topology.rank, ckpt, e)
            errors = self._errors(error)
            if not errors:
                if passed:
                    self._said_instead(fs, root, chosen, passed[0])
                return ckpt, got
            failed = errors[0]
            self._log(f"{failed}; trying {'another copy' if tag is not None else 'an older checkpoint'}",
                      logging.WARNING)
            passed += (chosen,)

    def _said_instead(self, fs, root: str, chosen: str, first: str) -> None:
        if self.topology.rank == 0:
            latest, _ = cread.read_latest(fs, root)
            first_tag = cread.tag_of(first)
            self._log(f"loading checkpoint {chosen} instead of {first_tag}"
                      f"{' (latest)' if first_tag == latest else ''}", logging.WARNING)

    def newest_step(self, path_or_uri: str) -> int:
        """The step of the checkpoint a load without a tag would try first (-1: none), from the
        manifests alone (no tensor is read)."""
        try:
            fs, root = cio.filesystem(path_or_uri)
            first = cread.preferred(fs, root)
        except (OSError, CheckpointError):
            return -1
        return first.step if first is not None else -1

    def load(self, path_or_uri: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True, load_module_only: bool = False
             ) -> Tuple[Optional[str], Optional[dict]]:
        """Load a checkpoint saved at any world size/stage; every rank calls it.

        Returns (checkpoint path, rank 0's client_state), or (None, None) when there is none.
        """
        self._settle_previous()
        fs, root = cio.filesystem(path_or_uri)
        ckpt, got = self._read_agreed(fs, root, tag)
        if ckpt is None:
            return None, None
        meta, saved, extras, rng = got
        error = None
        try:
            optimizer = load_optimizer_states and not load_module_only
            scheduler = load_lr_scheduler_states and not load_module_only
            cstate.apply(self._train_state(), saved, extras, rng, meta, optimizer, scheduler,
                         load_module_only)
        except Exception as e:  # noqa: BLE001 - every rank learns of a failure on any rank
            error = _load_failure(self.topology.rank, ckpt, e)
        self._agree(error)
        self._log(f"loaded checkpoint {ckpt} (saved by {meta['world_size']} rank(s), "
                  f"ZeRO stage {meta['zero_stage']})")
        return ckpt, meta["client_state"]
