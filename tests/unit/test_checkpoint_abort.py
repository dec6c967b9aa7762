"""abort_waits ends a commit wait at once (a Ray worker tearing down a group whose peer died)."""
from __future__ import annotations

import threading
import time

import pytest

from hybrid_ray.engine.checkpoint import write as checkpoint_write
from hybrid_ray.engine.checkpoint import CheckpointError


def test_abort_ends_a_commit_wait_now_and_clear_restores_waiting() -> None:
    box = {}

    def wait() -> None:
        try:
            checkpoint_write._poll(lambda: None, 60.0, "the files of ranks [1]")
        except CheckpointError as exc:
            box["error"] = str(exc)

    t = threading.Thread(target=wait)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)
    checkpoint_write.abort_waits()
    t.join(5)
    checkpoint_write.clear_abort()
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert "stopped waiting for the files of ranks [1]: the run is being torn down" in box["error"]
    assert checkpoint_write._poll(lambda: 7, 1.0, "x") == 7


def test_a_wait_still_times_out_without_abort() -> None:
    with pytest.raises(CheckpointError, match="gave up after 0.3 s"):
        checkpoint_write._poll(lambda: None, 0.3, "x")
