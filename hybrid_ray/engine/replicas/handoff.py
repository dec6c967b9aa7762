"""A lone worker's state, handed to another process that keeps it (a warm spare).

With one rank there is no buddy: the ring only copies the shard to this process's host memory,
which dies with it. A warm spare (an idle process that waits to replace the worker) can hold
the copy instead: the cluster layer takes the worker's newest committed copy (`exported`),
moves it, and the spare keeps it as a buddy keeps its predecessor's (`import_copy`), so that
when it replaces the worker, the engine's recovery finds that version in its own keeper and
reads nothing from storage. How the bytes travel is the caller's business: the copy is plain
numpy arrays (bf16 as int16) and bytes, which Ray moves without pickling the data.

On one node the copies need not travel at all: the spare creates shared slots (`open_slots`,
slots.py), the worker maps them (`attach_slots`) and its copies land there from then on, and the
spare takes the newest whole one as its held copy when it starts training (`adopt_slots`).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import numpy as np
import torch

from . import slots as sl
from .keeper import KEEPER, Keeper
from .snapshot import Snapshot

_SPARE_SLOTS: Optional[sl.Slots] = None  # a spare's: the slots a lone worker on its node writes into


def newest_step(keeper: Keeper = KEEPER) -> int:
    """The newest committed version of this process's own host copy (-1: none)."""
    return keeper.newest_copy()


@contextmanager
def exported(after: int, keeper: Keeper = KEEPER) -> Iterator[Optional[dict]]:
    """This process's newest committed host copy newer than `after` as plain data, or None.
    The arrays are views of the snapshot's own buffers, which stay out of reuse until the block
    ends: send (serialise) them inside it. No copy here: at 350M the state is 4.2 GB, and each
    copy on the way to the spare costs seconds that the spare's copy falls behind by."""
    snap = keeper.lease_newest_own(after)
    if snap is None:
        yield None
        return
    try:
        tensors = [{k: (str(t.dtype).removeprefix("torch."), _array(t)) for k, t in ts.items()}
                   for ts in snap.tensors]
        yield {"step": snap.step, "rank": snap.rank, "world": snap.world, "small": snap.small,
               "run": snap.run, "tensors": tensors, "disk_step": keeper.disk_step}
    finally:
        keeper.release(snap)


def import_copy(wire: Optional[dict], keeper: Keeper = KEEPER) -> int:
    """Keep `wire` (what `exported` gave) as the held copy of this process; the step held now (None:
    only asks; -1: nothing held), in its keeper or its slots."""
    if wire is None:
        slots = _SPARE_SLOTS
        got = slots.newest() if slots is not None else None
        return max(max(keeper.held, default=-1), got[1] if got is not None else -1)
    tensors = [{k: _tensor(dtype, a) for k, (dtype, a) in ts.items()} for ts in wire["tensors"]]
    keeper.keep_copy(Snapshot(wire["step"], wire["rank"], wire["world"], tensors, wire["small"], wire["run"],
                              borrowed=True))
    keeper.saw_disk(wire["run"], wire["disk_step"])
    return wire["step"]


def _array(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits travel as int16
        t = t.view(torch.int16)
    return t.numpy()


def _tensor(dtype: str, a: np.ndarray) -> torch.Tensor:
    """A view of the received array, not a copy: copying 4.2 GB (350M's state) took the spare
    1.4 s per push. Ray's arrays are read-only views of its object store, which keeps them while
    they are referenced; the snapshot is marked borrowed, so nothing writes into them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": nothing writes to it
        t = torch.from_numpy(a)
    want: Dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}
    return t.view(want[dtype]) if dtype in want else t


# ---- shared slots on one node (slots.py) ------------------------------------------------
def slot_spec(wire: dict) -> dict:
    """The slots a copy like `wire` (what `exported` gave) needs."""
    layout = [[(k, dtype, int(a.size)) for k, (dtype, a) in ts.items()] for ts in wire["tensors"]]
    return sl.spec_of(layout, len(wire["small"]))


def open_slots(spec: dict) -> str:
    """A spare's: new slots for a lone worker on this node to write into (any older ones go);
    their path, for the worker's `attach_slots`. Raises slots.SlotError."""
    global _SPARE_SLOTS
    close_slots()
    _SPARE_SLOTS = sl.Slots.create(spec)
    return _SPARE_SLOTS.path


def holds_slots() -> bool:
    return _SPARE_SLOTS is not None


def close_slots() -> None:
    global _SPARE_SLOTS
    slots, _SPARE_SLOTS = _SPARE_SLOTS, None
    if slots is not None:
        slots.unlink()


def adopt_slots(keeper: Keeper = KEEPER) -> int:
    """A spare about to train: the newest whole copy in its slots becomes its held copy, when
    newer than the one it holds; the step adopted (-1: none). The slots go: their writer is gone
    (or part of the group now)."""
    global _SPARE_SLOTS
    slots, _SPARE_SLOTS = _SPARE_SLOTS, None
    if slots is None:
        return -1
    slots.unlink()
    got = slots.read()
    if got is None:
        return -1
    desc, tensors = got
    if keeper.run == desc["run"] and desc["step"] <= max(keeper.held, default=-1):
        return -1
    tensors = sl.settled(slots, desc, tensors)
    if tensors is None:
        return -1
    keeper.keep_copy(sl.as_snapshot(desc, tensors))
    keeper.saw_disk(desc["run"], desc["disk_step"])
    return desc["step"]


def attach_slots(path: str, spec: dict, keeper: Keeper = KEEPER) -> None:
    """A lone worker's: its copies go into the spare's slots at `path` from the next one on.
    Raises slots.SlotError (another node's path, a spare gone)."""
    slots = sl.Slots.attach(path, spec)
    slots.unlink()  # both processes map it now: the memory goes with the last of them
    pin = torch.cuda.is_available() and torch.cuda.is_initialized()
    old = keeper.swap_slot_writer(sl.SlotWriter(slots, pin))
    if old is not None:
        old.close()


def want_copies(wanted: bool, keeper: Keeper = KEEPER) -> None:
    """A lone worker's: whether warm spares take its copies (replay mode makes them only then)."""
    keeper.copies_wanted = wanted


def detach_slots(keeper: Keeper = KEEPER) -> None:
    """A lone worker's: its copies go to its own memory again (the spare went, or joined)."""
    old = keeper.swap_slot_writer(None)
    if old is not None:
        old.close()
