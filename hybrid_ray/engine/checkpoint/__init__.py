"""Checkpoints that load at any world size and ZeRO stage, survive crashes, save asynchronously.

    checkpointer.py  Checkpointer, an engine's save/load face (the layout of a checkpoint)
    state.py         what a checkpoint holds: snapshot of a live engine, and putting it back
    write.py         writing and committing one checkpoint, with no collective
    read.py          finding and verifying committed checkpoints
    storage.py       bytes through pyarrow.fs (local paths and URIs)
    retention.py     which old checkpoints to delete after a commit
    offline.py       inspect and export without an engine or a process group
"""
from .checkpointer import Checkpointer
from .state import StepCounters, TrainState
from .storage import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "StepCounters", "TrainState"]
