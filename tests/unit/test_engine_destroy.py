"""destroy(), `with engine:` and the release at interpreter exit, in one process (no group).

The 2-rank exits, with a real gloo group torn down by the script, are
tests/distributed/test_clean_exit.py.
"""
from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybrid_ray
from hybrid_ray.engine import lifecycle

# The delayed offload update and the asynchronous checkpoint each run on a thread of their own.
THREADED = {"train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                    "delayed_param_update": True}},
            "checkpoint": {"async_save": True}}


@pytest.fixture(autouse=True)
def _earlier_threads() -> None:
    # An engine an earlier test dropped without destroy() keeps its threads until it is
    # collected: those are not this test's.
    gc.collect()
    _EARLIER.clear()
    _EARLIER.update(threading.enumerate())


_EARLIER: set = set()


def our_threads() -> List[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hybrid_ray") and t not in _EARLIER]


def build() -> hybrid_ray.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return hybrid_ray.initialize(model, config=THREADED)[0]


def train(engine: hybrid_ray.Engine, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def assert_destroyed(engine: hybrid_ray.Engine) -> None:
    assert our_threads() == []
    assert engine.topology.group is None
    for name in lifecycle.HOLDS_GROUP:
        assert name not in vars(engine)
    with pytest.raises(AttributeError, match="this engine was destroyed"):
        engine.step()


def test_destroy_stops_threads_and_drops_the_group(tmp_path: Path) -> None:
    engine = build()
    train(engine)
    engine.save_checkpoint(str(tmp_path))  # still being written in the background
    assert any(n.startswith("hybrid_ray-offload") for n in our_threads())
    assert any(n.startswith("hybrid_ray-ckpt") for n in our_threads())
    engine.destroy()
    assert_destroyed(engine)
    assert (tmp_path / "latest").read_text() == "global_step3"  # the save was waited for
    # What the caller may still read: the module (with the landed delayed update), counters.
    assert engine.global_steps == 3
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    engine.destroy()  # a second call, and close() after destroy(), do nothing
    engine.close()


def test_with_block_destroys_the_engine() -> None:
    with hybrid_ray.initialize(nn.Linear(6, 3), config=THREADED)[0] as engine:
        train(engine)
        assert our_threads()
    assert_destroyed(engine)


def test_with_block_destroys_after_an_exception_and_lets_it_through() -> None:
    with pytest.raises(ValueError, match="from the block"):
        with build() as engine:
            train(engine)
            raise ValueError("from the block")
    assert_destroyed(engine)


def test_engines_alive_at_exit_are_released() -> None:
    kept = build()
    train(kept)
    # Without threads of its own: a dropped executor's idle thread ends a moment after.
    plain = {k: v for k, v in THREADED.items() if k not in ("zero_optimization", "checkpoint")}
    dropped = hybrid_ray.initialize(nn.Linear(6, 3), config=plain)[0]
    train(dropped)
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None  # nothing holds an engine the caller let go of
    lifecycle.release_all()  # what the atexit hook runs
    assert_destroyed(kept)
