"""Child process of test_checkpoint_crash.py: saves twice, then is killed during a third save.

    python -m tests.unit.checkpoint_crash_child DIR MODE

MODE `mid-file-async`: the third save is asynchronous; its background writer stops halfway
through a parameter file while the training thread keeps stepping. MODE `before-move`: a
synchronous save stops after its manifest is written into the staging directory, before the
directory move that commits it. Either way the child touches DIR/paused and waits to be killed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from hybrid_ray.engine.checkpoint import storage as cio
from hybrid_ray.engine.checkpoint import write as cwrite
from tests.unit.test_checkpoint import make, state, train


def pause(root: Path) -> None:
    (root / "paused").touch()
    time.sleep(600)  # the parent kills us long before this ends


def half_write(root: Path):
    def write_tensors(fs, path, tensors, fsync=False):
        data = cio.tensors_to_bytes(tensors)
        with fs.open_output_stream(path) as f:
            f.write(data[: len(data) // 2])
            f.flush()
            pause(root)
    return write_tensors


def stop_before_move(root: Path):
    def move_dir(fs, src, dst):
        assert (Path(src) / "manifest.json").exists()
        pause(root)
    return move_dir


def main(root: Path, mode: str) -> None:
    engine = make()
    for step in (1, 2):
        train(engine, range(step - 1, step))
        engine.save_checkpoint(root)
        torch.save(state(engine), root / f"want{step}.pt")
    train(engine, range(2, 3))
    if mode == "mid-file-async":
        cwrite.cio.write_tensors = half_write(root)
        engine.save_checkpoint(root, async_save=True)
        step = 3
        while True:  # training goes on until the kill
            train(engine, range(step, step + 1))
            step += 1
    cwrite.cio.move_dir = stop_before_move(root)
    engine.save_checkpoint(root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
