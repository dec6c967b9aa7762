"""A lone worker's state, handed to another process that keeps it (a warm spare).

With one rank there is no buddy: the ring only copies the shard to this process's host memory,
which dies with it. A warm spare (an idle process that waits to replace the worker) can hold
the copy instead: the cluster layer takes the worker's newest committed copy (`export_newest`),
moves it, and the spare keeps it as a buddy keeps its predecessor's (`import_copy`), so that
when it replaces the worker, the engine's recovery finds that version in its own keeper and
reads nothing from storage. How the bytes travel is the caller's business: the copy is plain
numpy arrays (bf16 as int16) and bytes, which Ray moves without pickling the data.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from .keeper import KEEPER, Keeper
from .snapshot import Snapshot


def newest_step(keeper: Keeper = KEEPER) -> int:
    """The newest committed version of this process's own host copy (-1: none)."""
    return keeper.newest_copy()


def export_newest(after: int, keeper: Keeper = KEEPER) -> Optional[dict]:
    """This process's newest committed host copy newer than `after`, as plain data (a copy:
    the snapshot's buffers are reused by later versions), or None."""
    snap = keeper.lease_newest_own(after)
    if snap is None:
        return None
    try:
        tensors = [{k: (str(t.dtype).removeprefix("torch."), _array(t)) for k, t in ts.items()}
                   for ts in snap.tensors]
        return {"step": snap.step, "rank": snap.rank, "world": snap.world, "small": snap.small,
                "run": snap.run, "tensors": tensors, "disk_step": keeper.disk_step}
    finally:
        keeper.release(snap)


def import_copy(wire: Optional[dict], keeper: Keeper = KEEPER) -> int:
    """Keep `wire` (export_newest's) as the held copy of this process; the step held now (None:
    only asks; -1: nothing held)."""
    if wire is None:
        return max(keeper.held, default=-1)
    tensors = [{k: _tensor(dtype, a) for k, (dtype, a) in ts.items()} for ts in wire["tensors"]]
    keeper.keep_copy(Snapshot(wire["step"], wire["rank"], wire["world"], tensors, wire["small"], wire["run"]))
    keeper.saw_disk(wire["run"], wire["disk_step"])
    return wire["step"]


def _array(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits travel as int16
        t = t.view(torch.int16)
    return t.numpy().copy()


def _tensor(dtype: str, a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.array(a, copy=True))  # a received array may be read-only shared memory
    want: Dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}
    return t.view(want[dtype]) if dtype in want else t
