"""Asynchronous saves in one process: snapshot semantics, ordering, errors, parts, data position."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hybrid_ray.config import ConfigError, load_config
from hybrid_ray.engine.checkpoint import write as cwrite
from hybrid_ray.engine import CheckpointError
from tests.unit.test_checkpoint import CFG, assert_equal_state, make, state, train


@pytest.fixture
def gate(monkeypatch):
    """Background writes wait until gate.set(): lets a test act while a save is in flight."""
    event, real = threading.Event(), cwrite.write_files

    def gated(job):
        assert event.wait(30), "test never opened the gate"
        return real(job)

    monkeypatch.setattr(cwrite, "write_files", gated)
    return event


def test_async_save_is_a_snapshot_committed_in_background(tmp_path: Path, gate) -> None:
    engine = make()
    train(engine, range(2))
    want = state(engine)
    path = engine.save_checkpoint(tmp_path, async_save=True)
    assert path.endswith("global_step2")
    assert not (tmp_path / "global_step2").exists() and not (tmp_path / "latest").exists()
    train(engine, range(2, 4))  # training goes on while the save is in flight
    gate.set()
    assert engine.wait_checkpoint() == path
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert engine.wait_checkpoint() is None  # nothing in flight any more
    loaded = make(seed=1)
    loaded.load_checkpoint(tmp_path)
    assert loaded.global_steps == 2
    got = state(loaded)
    assert all(torch.equal(got[n][k], want[n][k]) for n in want for k in want[n])


def test_next_save_waits_for_the_previous_one(tmp_path: Path, gate) -> None:
    engine = make(cfg={**CFG, "checkpoint": {"async_save": True}})  # the config's default
    train(engine, range(1))
    engine.save_checkpoint(tmp_path)
    assert engine.checkpointer.busy
    threading.Timer(0.2, gate.set).start()
    train(engine, range(1, 2))
    engine.save_checkpoint(tmp_path)  # blocks until the first is committed, then starts
    assert (tmp_path / "global_step1" / "manifest.json").exists()
    engine.close()  # waits for the second
    assert (tmp_path / "latest").read_text() == "global_step2"
    loaded = make(seed=1)
    loaded.load_checkpoint(tmp_path)
    assert_equal_state(engine, loaded)


def failing_writes(monkeypatch, times: int) -> list:
    """cio.write_tensors raises OSError `times` times (recorded in the returned list)."""
    failures, real = [], cwrite.cio.write_tensors

    def write(fs, path, tensors, fsync=False):
        if len(failures) < times:
            failures.append(path)
            raise OSError("disk full (test)")
        return real(fs, path, tensors, fsync)

    monkeypatch.setattr(cwrite.cio, "write_tensors", write)
    return failures


def test_background_error_surfaces_once_on_the_next_call(tmp_path: Path, monkeypatch) -> None:
    engine = make()
    train(engine, range(1))
    failing_writes(monkeypatch, 1)
    engine.save_checkpoint(tmp_path, async_save=True)  # returns: the failure is in the background
    with pytest.raises(CheckpointError, match=r"rank 0: writing .*global_step1\.tmp-\w+: OSError: disk full"):
        engine.wait_checkpoint()
    assert engine.wait_checkpoint() is None  # raised once
    assert not (tmp_path / "latest").exists()
    failing_writes(monkeypatch, 1)
    engine.save_checkpoint(tmp_path, async_save=True)
    with pytest.raises(CheckpointError, match="the previous asynchronous save failed: .*disk full"):
        engine.save_checkpoint(tmp_path, tag="next")  # a save surfaces it too, then works
    path = engine.save_checkpoint(tmp_path, tag="next")
    assert (tmp_path / "latest").read_text() == "next" and path.endswith("next")
    # the failed saves' staging directories were cleaned up by the commit that followed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "next"]
    failing_writes(monkeypatch, 1)
    engine.save_checkpoint(tmp_path, tag="x", async_save=True)
    with pytest.raises(CheckpointError, match="disk full"):
        engine.close()  # close surfaces it as well


def test_parts_split_large_state_and_load_bitwise(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cwrite, "PART_BYTES", 400)  # a few tensors per part
    engine = make()
    train(engine, range(2))
    engine.save_checkpoint(tmp_path, async_save=True)
    engine.wait_checkpoint()
    parts = sorted(p.name for p in (tmp_path / "global_step2").glob("params-rank00000-*"))
    assert len(parts) > 3 and parts[0].startswith("params-rank00000-00000")
    loaded = make(seed=1)
    loaded.load_checkpoint(tmp_path)
    assert_equal_state(engine, loaded)


def test_split_parts_bounds_part_size() -> None:
    tensors = {"a": torch.zeros(10), "b": torch.zeros(100), "c": torch.zeros(5), "d": torch.zeros(5)}
    parts = cwrite.split_parts("p", tensors, limit=80)  # 40, 400, 20, 20 bytes
    assert [sorted(p) for p in parts.values()] == [["a"], ["b"], ["c", "d"]]
    assert list(parts)[0].startswith("p-00000.")


class Sampler:
    """A resumable sampler by global sample index: the interface the data helper provides."""

    def __init__(self) -> None:
        self.position, self.epoch = 0, 0

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.epoch = state["position"], state["epoch"]


class Loader:
    def __init__(self) -> None:
        self.sampler = Sampler()


def test_data_position_is_saved_and_restored(tmp_path: Path, caplog) -> None:
    engine = make()
    engine.training_dataloader = Loader()
    engine.training_dataloader.sampler.position, engine.training_dataloader.sampler.epoch = 48, 2
    train(engine, range(1))
    engine.save_checkpoint(tmp_path, async_save=True)
    engine.training_dataloader.sampler.position = 64  # after the snapshot: not in the checkpoint
    engine.wait_checkpoint()
    resumed = make(seed=1)
    resumed.training_dataloader = Loader()
    resumed.load_checkpoint(tmp_path)
    assert resumed.training_dataloader.sampler.state_dict() == {"position": 48, "epoch": 2}
    module_only = make(seed=1)
    module_only.training_dataloader = Loader()
    module_only.load_checkpoint(tmp_path, load_module_only=True)
    assert module_only.training_dataloader.sampler.position == 0
    plain = make(seed=1)  # no loader: the position is there, but nothing takes it
    with caplog.at_level("WARNING", logger="hybrid_ray"):
        plain.load_checkpoint(tmp_path)
    assert "data position not restored" in caplog.text


def test_data_position_must_be_json(tmp_path: Path) -> None:
    engine = make()
    engine.training_dataloader = Loader()
    engine.training_dataloader.sampler.position = torch.tensor(3)
    with pytest.raises(CheckpointError, match=r"training_dataloader sampler.state_dict\(\) must be JSON"):
        engine.save_checkpoint(tmp_path)


@pytest.mark.parametrize("section, message", [
    ({"keep_every": 5}, "checkpoint.keep_every: needs keep_last; got 5"),
    ({"keep_last": 0}, "checkpoint.keep_last: out of range; got 0; allowed: >= 1"),
    ({"asyncsave": True}, "checkpoint.asyncsave: unknown key; did you mean 'async_save'?"),
    ({"commit_timeout_s": 0}, "checkpoint.commit_timeout_s: out of range; got 0"),
])
def test_checkpoint_section_is_validated(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"checkpoint": section})
    assert str(err.value).startswith(message)


def test_commit_gives_up_on_a_silent_rank_and_tells_the_others(tmp_path: Path) -> None:
    from hybrid_ray.engine.checkpoint import storage as cio
    fs, root = cio.filesystem(tmp_path)
    settings = load_config({"train_batch_size": 1, "checkpoint": {"commit_timeout_s": 0.2}}).checkpoint
    rank0 = cwrite.SaveJob(fs, root, "t", "abcd", 0, 2, 5, settings, byte_files={"meta.json": b"{}"})
    fs.create_dir(rank0.staging)
    with pytest.raises(CheckpointError, match=r"gave up after 0.2 s waiting for the files of ranks \[1\]"):
        cwrite.run(rank0)  # rank 1 never writes its marker
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()
    rank1 = cwrite.SaveJob(fs, root, "t", "abcd", 1, 2, 5, settings, byte_files={"rng-rank00001.json": b"{}"})
    with pytest.raises(CheckpointError, match=r"rank 0 did not commit .*/t: gave up after 0.2 s"):
        cwrite.run(rank1)  # a late rank 1 finds rank 0's abort.json instead of waiting


def test_host_buffers_share_one_allocation_and_are_reused() -> None:
    from hybrid_ray.engine.checkpoint.state import HostBuffers
    buffers = HostBuffers(pin=False)
    specs = [("a", torch.Size([3, 5]), torch.float32), ("b", torch.Size([]), torch.int64),
             ("c", torch.Size([7]), torch.bfloat16)]
    buffers.reserve("params", specs)
    a = buffers.copy("a", torch.ones(3, 5))
    b = buffers.copy("b", torch.tensor(7))
    c = buffers.copy("c", torch.arange(7).bfloat16())
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert all(t.data_ptr() % HostBuffers.ALIGN == 0 for t in (a, b, c))
    assert a.sum() == 15 and b.item() == 7 and c.float().sum() == 21  # no view overlaps another
    buffers.reserve("params", specs)  # same layout: the same memory
    assert buffers.copy("a", torch.zeros(3, 5)).data_ptr() == a.data_ptr()
    buffers.reserve("params", specs[:1])  # another layout: a new allocation, the old keys gone
    assert buffers.copy("a", torch.zeros(3, 5)).data_ptr() != a.data_ptr()
    assert "b" not in buffers._buffers


SAVE_AT_EXIT = """
import sys, time
import torch
from hybrid_ray.engine.checkpoint import storage as cio
from tests.unit.test_checkpoint import make, train
real = cio.write_tensors
def slow(*args, **kwargs):
    time.sleep(0.5)  # the script has ended meanwhile: the interpreter is shutting down
    return real(*args, **kwargs)
cio.write_tensors = slow
engine = make()
train(engine, range(1))
engine.save_checkpoint(sys.argv[1], async_save=True)
"""


def test_a_save_in_flight_when_the_script_ends_is_committed(tmp_path: Path) -> None:
    # The interpreter waits for the save's thread at shutdown; its file writers must still run
    # then (concurrent.futures refuses new work by that point, and the save was lost).
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SAVE_AT_EXIT, str(tmp_path)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "latest").read_text() == "global_step1", sorted(p.name for p in tmp_path.iterdir())
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
