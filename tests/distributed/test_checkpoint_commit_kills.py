"""A save killed (SIGKILL) right after any one of its filesystem operations, on either of 2 ranks,
leaves a checkpoint that loads bitwise: the previous one or the new one, never neither, never a
mix; once the new one has been seen, a later kill point never brings the old one back. The same
for a new tag and for a tag saved again over itself. The next save then finishes what was cut
short and leaves nothing behind."""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_ray.engine.checkpoint import storage as cio
from tests.distributed import spawn
from tests.unit.test_checkpoint import CFG, make, state, train

pytestmark = [pytest.mark.dist, pytest.mark.slow]
# One writer thread: the operations then come in the same order in every run.
ZERO1 = {**CFG, "zero_optimization": {"stage": 1}, "checkpoint": {"write_threads": 1}}


class _Out:
    """An output stream that counts as one operation once it is closed (the file is whole)."""

    def __init__(self, stream, done):
        self._stream, self._done = stream, done

    def write(self, data):
        return self._stream.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()
        self._done(f"write {self._path}")

    def close(self):
        self.__exit__()


class KillingFS(pafs.LocalFileSystem):
    """The local filesystem, counting every operation that changes it; SIGKILLs this process
    right after operation number `kill_at` (1-based) once armed."""

    kill_at, armed = 0, False

    def _done(self, what: str) -> None:
        if not self.armed:
            return
        self.ops = getattr(self, "ops", []) + [what]
        if len(self.ops) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def open_output_stream(self, path, *a, **k):
        out = _Out(super().open_output_stream(path, *a, **k), self._done)
        out._path = path.rsplit("/", 2)[-2:]
        return out

    def create_dir(self, path, *a, **k):
        super().create_dir(path, *a, **k)
        self._done(f"mkdir {path}")

    def move(self, src, dest):
        super().move(src, dest)
        self._done(f"move {src} {dest}")

    def delete_dir(self, path):
        super().delete_dir(path)
        self._done(f"rmdir {path}")

    def delete_file(self, path):
        super().delete_file(path)
        self._done(f"rm {path}")

    def copy_file(self, src, dest):
        super().copy_file(src, dest)
        self._done(f"copy {src} {dest}")


def save_twice(rank: int, world: int, root: str, second_tag: str, kill_rank: int, kill_at: int,
               out: str) -> None:
    """Save tag 'a' at step 1, train a step, save `second_tag` with rank `kill_rank` killed after
    its operation `kill_at` of that save (0: no kill; then the operations are written to `out`
    and copies of both checkpoints kept beside it)."""
    fs = KillingFS()
    fs.kill_at = kill_at if rank == kill_rank else 0
    cio.filesystem = lambda path: (fs, os.path.abspath(os.fspath(path)))
    engine = make(cfg=ZERO1)
    train(engine, range(1))
    engine.save_checkpoint(root, tag="a")
    if kill_at == 0 and rank == 0:
        shutil.copytree(root, f"{out}/first")
    train(engine, range(1, 2))
    fs.armed = True
    engine.save_checkpoint(root, tag=second_tag)
    fs.armed = False
    if kill_at == 0:
        if rank == 0:
            shutil.copytree(root, f"{out}/second")
        Path(f"{out}/ops-rank{rank}.json").write_text(json.dumps(getattr(fs, "ops", [])))
    dist.barrier()


def loaded(root: Path, **kwargs) -> tuple:
    engine = make(seed=7, cfg=ZERO1)
    path, _ = engine.load_checkpoint(str(root), **kwargs)
    return engine.global_steps, state(engine)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


@pytest.mark.parametrize("second_tag", ["b", "a"], ids=["new-tag", "re-saved-tag"])
def test_a_kill_after_any_operation_of_a_commit_leaves_a_loadable_checkpoint(tmp_path, second_tag):
    ref = tmp_path / "ref"
    ref.mkdir()
    spawn.run(save_twice, 2, str(tmp_path / "clean"), second_tag, 0, 0, str(ref), timeout_s=60)
    ops = {r: json.loads((ref / f"ops-rank{r}.json").read_text()) for r in (0, 1)}
    old, new = loaded(ref / "first"), loaded(ref / "second")
    assert old[0] == 1 and new[0] == 2 and not same(old[1], new[1])
    assert len(ops[0]) >= 8 and len(ops[1]) >= 3, ops  # files, markers, manifest, moves, latest
    outcomes = {}
    for rank in (0, 1):
        seen_new = False
        for k in range(1, len(ops[rank]) + 1):
            root = tmp_path / f"kill-r{rank}-{k}"
            with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
                spawn.run(save_twice, 2, str(root), second_tag, rank, k, "", timeout_s=60)
            got = loaded(root)
            which = "new" if same(got[1], new[1]) else "old" if same(got[1], old[1]) else "neither"
            assert which != "neither", f"rank {rank} killed after {ops[rank][k - 1]}"
            assert got[0] == (2 if which == "new" else 1)
            assert not (seen_new and which == "old"), f"old again after {ops[rank][k - 1]}"
            seen_new |= which == "new"
            outcomes[(rank, k)] = which
            settle_with_another_save(root, second_tag, which)
    # rank 1 finishing its files (the last: its marker) is what lets rank 0 commit
    assert {w for (r, k), w in outcomes.items() if r == 1 and k < len(ops[1])} == {"old"}
    assert outcomes[(0, len(ops[0]))] == "new"


def settle_with_another_save(root: Path, second_tag: str, which: str) -> None:
    """One more save (one process): what the killed commit left is completed or removed, and the
    tag it was writing still loads as it did right after the kill."""
    engine = make(seed=7, cfg=ZERO1)
    engine.load_checkpoint(str(root))
    before = state(engine)
    engine.save_checkpoint(str(root), tag="c")
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]
    assert (root / "latest").read_text() == "c"
    tag = second_tag if which == "new" else "a"
    assert same(loaded(root, tag=tag)[1], before)
