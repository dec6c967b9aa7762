"""A process killed (SIGKILL) in the middle of a save leaves the previous checkpoint loadable;
corrupt files are caught by their checksums."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid_ray.cli import main as cli
from hybrid_ray.engine import CheckpointError
from tests.unit.test_checkpoint import make, state, train

REPO = Path(__file__).resolve().parents[2]


def kill_mid_save(root: Path, mode: str) -> None:
    """Run checkpoint_crash_child until it pauses inside its third save, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "tests.unit.checkpoint_crash_child", str(root), mode],
                             cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not (root / "paused").exists():
            assert child.poll() is None, f"child exited early: {child.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "child never reached the pause"
            time.sleep(0.05)
        assert child.poll() is None  # alive, inside the save
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def assert_loads(root: Path, step: int, **kwargs) -> None:
    engine = make(seed=9)
    path, _ = engine.load_checkpoint(root, **kwargs)
    assert path.endswith(f"global_step{step}") and engine.global_steps == step
    want, got = torch.load(root / f"want{step}.pt", weights_only=True), state(engine)
    assert all(torch.equal(got[n][k], want[n][k]) for n in want for k in want[n])


@pytest.mark.slow
def test_kill_mid_write_of_async_save_then_corruption(tmp_path: Path, caplog, capsys) -> None:
    kill_mid_save(tmp_path, "mid-file-async")
    staging = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert [p.name.split(".tmp-")[0] for p in staging] == ["global_step3"]
    assert not (staging[0] / "manifest.json").exists()  # killed mid-file: never committed
    assert [p.name for p in staging[0].glob("params-rank*")]  # the half-written file
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert_loads(tmp_path, 2)
    assert cli(["checkpoint", "inspect", str(tmp_path), "--quick"]) == 0  # the leftover is no error
    assert "global_step3.tmp-" in capsys.readouterr().out
    # flip one byte of step 2's parameters (same size: only the sha256 can tell)
    params = next((tmp_path / "global_step2").glob("params-rank*"))
    data = bytearray(params.read_bytes())
    data[len(data) // 2] ^= 0xFF
    params.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
        assert_loads(tmp_path, 1)  # latest falls back to the newest good one
    assert "global_step2 is corrupt" in caplog.text and "instead of global_step2 (latest)" in caplog.text
    with pytest.raises(CheckpointError) as err:
        make().load_checkpoint(tmp_path, tag="global_step2")
    assert "\n" not in str(err.value)
    assert str(err.value).endswith(f"global_step2 is corrupt: {params.name} fails its sha256 check "
                                   f"({len(data)} bytes, manifest says {len(data)})")
    assert cli(["checkpoint", "inspect", str(tmp_path), "--tag", "global_step2"]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if "mismatch" in line]
    assert len(bad) == 1 and params.name in bad[0] and bad[0].endswith("sha256 mismatch")


@pytest.mark.slow
def test_kill_between_manifest_and_move(tmp_path: Path) -> None:
    kill_mid_save(tmp_path, "before-move")
    staging = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(staging) == 1 and (staging[0] / "manifest.json").exists()  # complete, not committed
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert_loads(tmp_path, 2)
    engine = make()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path, tag="after")  # the next commit removes the leftover
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())
