"""A set cancel handle ends a commit wait at once (a Ray worker tearing down a group whose peer
died sets its Topology.abort, which is the engine's Checkpointer.cancel_event)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hybrid_ray.engine.checkpoint import write as checkpoint_write
from hybrid_ray.engine import CheckpointError
from hybrid_ray.engine import Topology


def test_abort_ends_a_commit_wait_now_and_a_fresh_handle_restores_waiting() -> None:
    box = {}
    cancel = threading.Event()

    def wait() -> None:
        try:
            checkpoint_write._poll(lambda: None, 60.0, "the files of ranks [1]", cancel)
        except CheckpointError as exc:
            box["error"] = str(exc)

    t = threading.Thread(target=wait)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)
    cancel.set()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert "stopped waiting for the files of ranks [1]: the run is being torn down" in box["error"]
    assert checkpoint_write._poll(lambda: 7, 1.0, "x", threading.Event()) == 7


def test_a_wait_still_times_out_without_abort() -> None:
    with pytest.raises(CheckpointError, match="gave up after 0.3 s"):
        checkpoint_write._poll(lambda: None, 0.3, "x", threading.Event())


def test_the_engines_checkpointer_waits_on_its_topologys_abort() -> None:
    from hybrid_ray.engine import Engine

    topo = Topology(0, 1, torch.device("cpu"))
    engine = Engine(torch.nn.Linear(2, 2), {"train_batch_size": 1}, topology=topo)
    assert engine.checkpointer.cancel_event is topo.abort and not topo.abort.is_set()
    engine.checkpointer.cancel()
    assert topo.abort.is_set()
    engine.close()
