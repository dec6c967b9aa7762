"""Two slots of shared host memory that a lone worker copies its state into and its warm spare,
on the same node, reads once the worker is gone.

A lone worker's copies otherwise travel to its spare through Ray (handoff.py): each copy is
serialised into the object store and the spare takes it from there, one push at a time, so the
spare trails the worker by the copy interval plus a push (7 steps at 350M on one GPU, copying
every 4 steps). Here the spare allocates the memory (a file in /dev/shm, both processes map it)
and the worker's device-to-host copy lands in it directly: nothing is pushed, and the spare
holds a step as soon as its copy finished.

Two slots, so that a copy cut short by the worker's death never leaves the spare without a
whole one: a slot's header says the step it holds, and is marked invalid before its data is
overwritten and valid only after the data and the small state are all in (the worker may be
killed between any two writes). The reader takes the newest valid slot.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

import psutil
import torch

from ..zero import pinned
from .snapshot import Snapshot, pack, unpack

log = logging.getLogger("hybrid_ray")

Tensors = Dict[str, torch.Tensor]
_ALIGN = 64
_HEADER = 64  # int64 step (-1: invalid), int64 length of the small state, room to spare
_PREFIX = "hybrid_ray-slots-"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


class SlotError(RuntimeError):
    """Shared slots could not be created or mapped (no room in /dev/shm, another node)."""


def entries(tensors: List[Tensors]) -> List[List[Tuple[str, str, int]]]:
    """Per space, (key, dtype, numel) of each tensor: what a slot's layout is made of."""
    return [[(k, str(t.dtype).removeprefix("torch."), int(t.numel())) for k, t in ts.items()] for ts in tensors]


def spec_of(layout: List[List[Tuple[str, str, int]]], small_len: int) -> dict:
    """What the slots must hold: tensors laid out as `layout` (entries) and small state of about
    `small_len` bytes (with room to grow: its counters and RNG vary)."""
    return {"tensors": [[tuple(e) for e in ts] for ts in layout], "small": 2 * small_len + (1 << 20)}


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def slot_bytes(spec: dict) -> int:
    data = sum(_round(n * _DTYPES[d].itemsize) for ts in spec["tensors"] for _, d, n in ts)
    return _HEADER + _round(spec["small"]) + data


class Slots:
    """The two slots over one shared file: `create` (the spare) or `attach` (the worker)."""

    def __init__(self, path: str, spec: dict, buf: torch.Tensor) -> None:
        self.path, self.spec, self.buf = path, spec, buf
        self.size = slot_bytes(spec)

    @classmethod
    def create(cls, spec: dict, directory: str = "/dev/shm") -> "Slots":
        """New slots in `directory`, its space reserved up front: a mapping of a tmpfs file that
        outgrows the filesystem's room faults (SIGBUS) on first touch instead of failing here."""
        _sweep(directory)
        path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        total = 2 * slot_bytes(spec)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise SlotError(f"no room for {total / 1e9:.2f} GB of replica slots in {directory}: {e}") from e
        os.close(fd)
        slots = cls(path, spec, torch.from_file(path, shared=True, size=total, dtype=torch.uint8))
        for i in (0, 1):
            slots.header(i)[0] = -1
        return slots

    @classmethod
    def attach(cls, path: str, spec: dict) -> "Slots":
        total = 2 * slot_bytes(spec)
        try:
            if os.path.getsize(path) != total:
                raise SlotError(f"replica slots {path}: {os.path.getsize(path)} bytes, expected {total}")
            return cls(path, spec, torch.from_file(path, shared=True, size=total, dtype=torch.uint8))
        except OSError as e:  # another node's path, or the spare already gone
            raise SlotError(f"cannot map replica slots {path}: {e}") from e

    def unlink(self) -> None:
        """Drop the file's name: the memory lives on while a process maps it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def header(self, i: int) -> torch.Tensor:
        base = i * self.size
        return self.buf[base:base + 16].view(torch.int64)

    def small(self, i: int) -> torch.Tensor:
        base = i * self.size + _HEADER
        return self.buf[base:base + self.spec["small"]]

    def tensors(self, i: int) -> List[Tensors]:
        """Slot `i`'s tensors, typed views of the shared memory."""
        cursor, out = i * self.size + _HEADER + _round(self.spec["small"]), []
        for ts in self.spec["tensors"]:
            views = {}
            for key, dtype, numel in ts:
                nbytes = numel * _DTYPES[dtype].itemsize
                views[key] = self.buf[cursor:cursor + nbytes].view(_DTYPES[dtype])
                cursor += _round(nbytes)
            out.append(views)
        return out

    def steps(self) -> Tuple[int, int]:
        return int(self.header(0)[0]), int(self.header(1)[0])

    def newest(self) -> Optional[Tuple[int, int]]:
        """(slot, step) of the newest whole copy, or None."""
        steps = self.steps()
        best = max((0, 1), key=lambda i: steps[i])
        return (best, steps[best]) if steps[best] >= 0 else None

    def read(self) -> Optional[Tuple[dict, List[Tensors]]]:
        """The newest whole copy: its description (step, rank, world, small, run, disk_step) and
        its tensors (views: valid while this object's memory is)."""
        got = self.newest()
        if got is None:
            return None
        i, step = got
        n = int(self.header(i)[1])
        desc = unpack(self.small(i)[:n].numpy().tobytes())
        if desc["step"] != step:  # the header and the data disagree: never written whole
            return None
        return desc, self.tensors(i)


def fits(spec: dict, live: List[Tensors]) -> bool:
    return spec["tensors"] == entries(live)


class SlotWriter:
    """The worker's side: which slot the next copy goes to, and marking it whole afterwards.
    The training thread begins a copy and the copy thread finishes it; `close` (another thread:
    the spare went away) waits for a copy in flight, whose memory it unregisters."""

    def __init__(self, slots: Slots, pin: bool) -> None:
        self.slots = slots
        self.pinned = pin and _register(slots.buf)
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False

    def begin(self, live: List[Tensors]) -> Optional[Tuple[int, List[Tensors]]]:
        """The slot the next copy goes to and its tensors shaped as `live` (the slot not holding
        the newest whole copy), marked invalid first; None when the state no longer has the
        slots' layout (a precision switch) or the writer was closed. `end` must follow."""
        with self._cond:
            if self._closed or not fits(self.slots.spec, live):
                return None
            self._busy += 1
        got = self.slots.newest()
        i = 1 - got[0] if got is not None else 0
        self.slots.header(i)[0] = -1
        views = [{k: v.view(live[n][k].shape) for k, v in ts.items()} for n, ts in enumerate(self.slots.tensors(i))]
        return i, views

    def finish(self, i: int, snap: Snapshot, disk_step: int) -> bool:
        """Slot `i` now holds `snap`'s tensors (the caller has waited for the copies): write its
        description and mark it whole. False when the small state outgrew its room."""
        data = pack({"step": snap.step, "rank": snap.rank, "world": snap.world, "small": snap.small,
                     "run": snap.run, "disk_step": disk_step, "pid": os.getpid()})
        room = self.slots.small(i)
        if len(data) > room.numel():
            log.warning("replica slots: the small state (%d bytes) outgrew its room (%d)", len(data), room.numel())
            return False
        room[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        header = self.slots.header(i)
        header[1] = len(data)
        header[0] = snap.step  # last: only now is the slot whole
        return True

    def end(self) -> None:
        """The copy that `begin` started is over (finished or failed)."""
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def close(self, timeout_s: float = 120.0) -> None:
        """No more copies; once the one in flight is over, the memory is unregistered."""
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(lambda: self._busy == 0, timeout_s):
                log.warning("replica slots: a copy into them is still in flight; left registered")
                return
        if self.pinned:
            pinned.unregister(self.slots.buf.data_ptr())
            self.pinned = False

def _register(buf: torch.Tensor) -> bool:
    """Page-lock the mapping for asynchronous device-to-host copies into it."""
    if not torch.cuda.is_available():
        return False
    err = pinned.register(buf)
    if err != 0:
        log.warning("replica slots: cudaHostRegister of %.1f GB failed (cudaError %d): copies into "
                    "them stay synchronous", buf.numel() / 1e9, err)
    return err == 0


def _sweep(directory: str) -> None:
    """Remove slot files left by processes that died before removing them."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            pid = int(name[len(_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not psutil.pid_exists(pid):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def settled(slots: Slots, desc: dict, tensors: List[Tensors], wait_s: float = 3.0) -> Optional[List[Tensors]]:
    """`tensors` (the newest whole copy), safe to keep: as they are once their writer's process
    has exited (the driver killed it; it is usually gone already), else a private copy taken
    while the writer could not have reached this slot again; None if it did."""
    deadline = time.monotonic() + wait_s
    while _alive(desc.get("pid")) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _alive(desc.get("pid")):
        return tensors
    log.warning("replica slots: their writer (pid %s) is still alive; taking a private copy", desc.get("pid"))
    i = slots.newest()
    private = [{k: t.clone() for k, t in ts.items()} for ts in tensors]
    return private if slots.newest() == i and i is not None and i[1] == desc["step"] else None


def _alive(pid: Optional[int]) -> bool:
    """Whether the writer `pid` still runs (a zombie, killed and not yet reaped, does not)."""
    if pid is None or pid == os.getpid():
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def as_snapshot(desc: dict, tensors: List[Tensors]) -> Snapshot:
    """The copy as a held snapshot over the slot's memory (borrowed: never reused; its views
    keep the mapping alive)."""
    return Snapshot(desc["step"], desc["rank"], desc["world"], tensors, desc["small"], desc["run"], borrowed=True)
