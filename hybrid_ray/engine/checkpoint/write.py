"""Writing and committing one checkpoint from a host snapshot, with no collective.

It runs inline (synchronous save) or on a background thread (asynchronous save). A collective
issued from a second thread could interleave with the training thread's collectives on the same
process group and deadlock or mismatch, so the ranks agree through files instead:

1. every rank writes its files into the shared staging directory `<root>/<tag>.tmp-<token>`
   (tensor files in parts of at most PART_BYTES, several at once), then a marker
   `done-rank<r>.json` with each file's size and sha256, or the error it hit;
2. rank 0 waits for every marker (`checkpoint.commit_timeout_s`), writes manifest.json (every
   entry and the token), moves the directory to `<tag>` (a previous `<tag>` aside first),
   rewrites `latest`, then applies retention; if anything failed it writes `abort.json` into
   the staging directory instead;
3. the other ranks wait until `<tag>/manifest.json` carries their token, or abort.json appears,
   so that a save returns (or `wait_checkpoint()` does) on every rank only once the checkpoint
   is committed, and every rank learns of a failure on any rank.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hybrid_ray.config import CheckpointConfig
from . import storage as cio
from . import read as cread
from . import retention
from .liveness import Heartbeat
from .storage import CheckpointError

PART_BYTES = 1 << 30  # bounds the serialised copy each writer thread holds
ABORT = "abort.json"
Entries = Dict[str, Dict[str, Any]]  # file name -> {"sha256": ..., "bytes": ...}


@dataclass
class SaveJob:
    """One rank's share of one save: what to write where, and how to commit."""

    fs: Any
    root: str
    tag: str
    token: str
    rank: int
    world_size: int
    global_steps: int
    settings: CheckpointConfig
    tensor_files: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)
    byte_files: Dict[str, bytes] = field(default_factory=dict)
    # Set when the group is torn down (the engine's Checkpointer.cancel_event): a rank waiting
    # for the files of a peer that died would otherwise wait commit_timeout_s, and look frozen
    # to the driver meanwhile.
    cancel: threading.Event = field(default_factory=threading.Event)
    # The peers' pulse (liveness.py): a rank that dies mid-save is noticed in seconds.
    heartbeat: Optional[Heartbeat] = None

    @property
    def staging(self) -> str:
        return cio.join(self.root, cread.staging_name(self.tag, self.token))

    @property
    def final(self) -> str:
        return cio.join(self.root, self.tag)


def split_parts(prefix: str, tensors: Dict[str, torch.Tensor], limit: int = 0
                ) -> Dict[str, Dict[str, torch.Tensor]]:
    """{'<prefix>-00000<ext>': tensors, ...}: consecutive parts of at most `limit` bytes each
    (a tensor larger than the limit gets a part of its own)."""
    limit = limit or PART_BYTES
    parts: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if parts[-1] and size + nbytes > limit:
            parts.append({})
            size = 0
        parts[-1][key] = tensors[key]
        size += nbytes
    return {f"{prefix}-{i:05d}{cio.TENSOR_EXT}": p for i, p in enumerate(parts)}


# ---- step 1: this rank's files ----------------------------------------------------------------
def _write_one(job: SaveJob, name: str) -> Tuple[str, Dict[str, Any]]:
    path, fsync = cio.join(job.staging, name), job.settings.fsync
    if name in job.tensor_files:
        digest, size = cio.write_tensors(job.fs, path, job.tensor_files[name], fsync)
    else:
        cio.write_bytes(job.fs, path, job.byte_files[name], fsync)
        digest, size = cio.manifest_entry(job.byte_files[name])
    return name, {"sha256": digest, "bytes": size}


def write_files(job: SaveJob) -> Entries:
    """Checksum and write this rank's files, `write_threads` at a time (sha256 and pyarrow's
    writes release the GIL, so the threads overlap), largest first."""
    names = sorted(job.tensor_files, key=lambda n: -sum(t.numel() for t in job.tensor_files[n].values()))
    names += sorted(job.byte_files)
    if len(names) <= 1 or job.settings.write_threads == 1:
        return dict(_write_one(job, n) for n in names)
    return dict(_in_threads(lambda n: _write_one(job, n), names, job.settings.write_threads))


def _in_threads(fn: Callable[[str], Any], items: List[str], threads: int) -> List[Any]:
    """[fn(item) for item in items] on up to `threads` threads; the first error is raised.

    Plain threads, not concurrent.futures: a save still in flight when the script ends is
    waited for at interpreter shutdown, where concurrent.futures already refuses new work
    ("cannot schedule new futures after interpreter shutdown"), and that checkpoint was lost.
    """
    n = min(threads, len(items))
    results: Dict[int, Any] = {}
    errors: List[BaseException] = []

    def work(k: int) -> None:
        for i in range(k, len(items), n):  # largest first, dealt out in turn
            if errors:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - raised on the calling thread below
                errors.append(e)
                return
    pool = [threading.Thread(target=work, args=(k,), name=f"hybrid_ray-ckpt-write-{k}")
            for k in range(n)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(items))]


def _marker(rank: int) -> str:
    return f"done-rank{rank:05d}.json"


# ---- steps 2 and 3: agreeing through files --------------------------------------------------------
def _poll(what: Callable[[], Optional[Any]], timeout_s: float, waiting_for: str,
          cancel: threading.Event, heartbeat: Optional[Heartbeat] = None) -> Any:
    """Call `what` until it returns something, backing off from 20 ms to 0.5 s between calls;
    CheckpointError once timeout_s has passed, the job is cancelled or a peer is gone."""
    deadline, delay = time.monotonic() + timeout_s, 0.02
    while True:
        got = what()
        if got is not None:
            return got
        if heartbeat is not None:
            heartbeat.check()
        if cancel.is_set():
            raise CheckpointError(f"stopped waiting for {waiting_for}: the run is being torn down")
        if time.monotonic() > deadline:
            raise CheckpointError(f"gave up after {timeout_s:g} s waiting for {waiting_for} "
                                  "(checkpoint.commit_timeout_s)")
        time.sleep(delay)
        delay = min(2 * delay, 0.5)


def _try_json(fs, path: str) -> Optional[dict]:
    try:
        return cio.json_from_bytes(cio.read_bytes(fs, path))
    except (OSError, FileNotFoundError, ValueError):
        return None  # not there yet (or mid-move on a store without atomic moves)


def _collect_markers(job: SaveJob, entries: Entries) -> Entries:
    """Rank 0: every other rank's entries, from its marker; a rank's error becomes ours."""
    entries = dict(entries)
    pending = set(range(1, job.world_size))

    def arrived() -> Optional[bool]:
        for r in sorted(pending):
            marker = _try_json(job.fs, cio.join(job.staging, _marker(r)))
            if marker is None or marker.get("token") != job.token:
                continue
            if marker["error"]:
                raise CheckpointError(marker["error"])
            entries.update(marker["files"])
            pending.discard(r)
        return True if not pending else None

    waiting_for = f"the files of ranks {sorted(pending)} in {job.staging}"
    _poll(arrived, job.settings.commit_timeout_s, waiting_for, job.cancel, job.heartbeat)
    for r in range(1, job.world_size):
        job.fs.delete_file(cio.join(job.staging, _marker(r)))
    return entries


def _commit(job: SaveJob, entries: Entries) -> None:
    """Rank 0: the manifest into the staging directory, the directory to its name, `latest` at it.

    Crash-safe at every step, a re-saved tag included: the manifest completes the staged copy;
    the tag's previous copy, if any, is moved aside (not deleted) before the new one moves in,
    and deleted only once `latest` is rewritten and the moves are durable. A reader that finds
    the tag's own directory missing loads its staged copy, else its displaced one (read.choose),
    and the next commit finishes the move (retention.settle).
    """
    fs = job.fs
    manifest = {"format": cread.FORMAT, "tag": job.tag, "global_steps": job.global_steps,
                "token": job.token, "files": entries}
    cio.write_bytes(fs, cio.join(job.staging, cread.MANIFEST), cio.json_bytes(manifest),
                    fsync=job.settings.fsync)
    displaced = None
    if cio.exists(fs, job.final):
        displaced = cio.join(job.root, cread.displaced_name(job.tag, job.token))
        cio.move_dir(fs, job.final, displaced)
    cio.move_dir(fs, job.staging, job.final)
    cio.write_atomic(fs, cio.join(job.root, cread.LATEST), job.tag.encode())
    if job.settings.fsync and cio.is_local(fs):  # make the renames durable before the delete
        cio.fsync_path(job.root)
    if displaced is not None:
        fs.delete_dir(displaced)


def _await_commit(job: SaveJob) -> None:
    """Ranks > 0: until rank 0 has committed this save (manifest with our token) or aborted it."""
    def outcome() -> Optional[bool]:
        manifest = _try_json(job.fs, cio.join(job.final, cread.MANIFEST))
        if manifest is not None and manifest.get("token") == job.token:
            return True
        abort = _try_json(job.fs, cio.join(job.staging, ABORT))
        if abort is not None:
            raise CheckpointError(f"rank 0 did not commit {job.final}: {abort['error']}")
        return None

    # Rank 0 may itself wait commit_timeout_s for a slow rank before it aborts: wait longer.
    _poll(outcome, 2 * job.settings.commit_timeout_s, f"rank 0 to commit {job.final}", job.cancel,
          job.heartbeat)


def run(job: SaveJob) -> str:
    """Write this rank's share and take part in the commit; the checkpoint's path, or raises."""
    if job.heartbeat is None:
        return _run(job)
    job.heartbeat.start()
    try:
        return _run(job)
    finally:
        job.heartbeat.stop()


def _run(job: SaveJob) -> str:
    error, entries = None, {}
    try:
        entries = write_files(job)
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = f"rank {job.rank}: writing {job.staging}: {type(e).__name__}: {e}"
    if job.rank != 0:
        marker = {"token": job.token, "rank": job.rank, "files": entries, "error": error}
        cio.write_atomic(job.fs, cio.join(job.staging, _marker(job.rank)), cio.json_bytes(marker))
        if error:
            raise CheckpointError(error)
        _await_commit(job)
        return job.final
    try:
        if error:
            raise CheckpointError(error)
        _commit(job, _collect_markers(job, entries))
    except Exception as e:  # noqa: BLE001 - tell the waiting ranks, then fail here too
        message = str(e) if isinstance(e, CheckpointError) else \
            f"committing {job.final}: {type(e).__name__}: {e}"
        try:
            cio.write_atomic(job.fs, cio.join(job.staging, ABORT), cio.json_bytes({"error": message}))
        except OSError:
            pass  # the other ranks then time out
        raise CheckpointError(message) from None
    retention.apply(job.fs, job.root, job.settings.keep_last, job.settings.keep_every)
    return job.final


class BackgroundSaver:
    """At most one save in flight per engine (its Checkpointer owns it), on one background thread.

    The thread is not a daemon: an interpreter that exits waits for the save in flight.
    """

    def __init__(self) -> None:
        self._executor: Optional[cf.ThreadPoolExecutor] = None
        self._future: Optional[cf.Future] = None
        self.buffers = None  # the HostBuffers of asynchronous snapshots, reused between saves

    @property
    def busy(self) -> bool:
        return self._future is not None

    def submit(self, job: SaveJob) -> None:
        assert self._future is None, "wait() for the previous save first"
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="hybrid_ray-ckpt")
        self._future = self._executor.submit(run, job)

    def wait(self) -> Optional[str]:
        """The path of the save in flight once committed (None if none); raises its error once."""
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug or an unexpected storage error
            raise CheckpointError(f"asynchronous checkpoint save failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Drop the thread and the host buffers (call after wait())."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor, self.buffers = None, None
