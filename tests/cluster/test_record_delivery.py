"""Every step's record reaches the driver, on a real local Ray, however the workers die.

Workers are killed at seeded random steps, four times a run in five runs: rank 0 the moment a
checkpoint commits, or a random member; and right after the final checkpoint (22 kills in all).
A record lost with a worker is one the driver never gets; the resumed group redoes
only the steps after its checkpoint, and each checkpoint is saved after the driver acknowledged
every record before it (ctx.flush_reports), so every step 1..N must arrive: the first arrival
of each is what the LM driver's router passes on (replays are dropped there, test_lm_router).
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
from tests.cluster import trainfns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
STEPS, EVERY = 24, 2
SLOT = {"CPU": 1, "slot": 1}
FAST = dict(collective_timeout_s=8.0, heartbeat_timeout_s=30.0, start_timeout_s=30.0,
            grow_check_interval_s=1.0)


def trainer(tmp_path, name: str, fault=None, max_failures: int = 0) -> ElasticTrainer:
    fn = lambda ctx: trainfns.train_mlp(ctx, steps=STEPS, every=EVERY, fault=fault,  # noqa: E731
                                        step_delay=0.15)
    return ElasticTrainer(fn, ScalingConfig(min_workers=2, max_workers=2, resources_per_worker=SLOT),
                          FailureConfig(max_failures=max_failures, **FAST),
                          storage_path=str(tmp_path), run_name=name)


def steps_received(result) -> list:
    return [r["step"] for r in result.records if "loss" in r]


def steps_applied(result) -> list:
    """The steps whose loss the LM driver's router would log, in order: each exactly once."""
    from hybrid_ray.lm.router import RecordRouter

    class Tracker:  # the tracker's one call that matters here; the router needs nothing else
        def __init__(self):
            self.steps = []

        def log_metrics(self, metrics, step, monotonic=True):
            if "loss" in metrics:
                self.steps.append(step)
            return True

    tracker = Tracker()
    router = RecordRouter(tracker)
    for rec in result.records:
        router(rec)
    return tracker.steps


def latest_step(tmp_path, name: str) -> int:
    try:
        return int((tmp_path / name / "checkpoints" / "latest").read_text().rsplit("step", 1)[1])
    except (OSError, ValueError, IndexError):
        return -1


def kill_at(ray, t: ElasticTrainer, run: threading.Thread, steps: list, seed: int,
            committed) -> list:
    """At each of `steps`, kill: alternately rank 0 the moment a checkpoint at or after the
    step commits (its last records may not have reached the driver yet: the window a flush
    closes), and a random member once the driver has seen the step. Returns (kind, step, who)."""
    rng, done = random.Random(seed), []
    for i, step in enumerate(steps):
        after_commit = i % 2 == 0
        deadline = time.monotonic() + 150
        while t.controller is None or type(t.controller.state).__name__ != "Running" or \
                (committed() < step if after_commit else t.controller._last_step < step):
            assert run.is_alive() and time.monotonic() < deadline, (step, done)
            time.sleep(0.005)
        members = t.controller.group.members
        victim = members[0] if after_commit else rng.choice(members)
        ray.kill(victim.handle, no_restart=True)
        done.append(("after commit" if after_commit else "random", step, victim.index))
        while type(t.controller.state).__name__ == "Running" and run.is_alive():
            time.sleep(0.02)  # until the controller noticed: the next kill is in the next group
    return done


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_every_step_arrives_across_repeated_kills(ray_session, tmp_path, seed) -> None:
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(2, STEPS - 1), 4))
    t = trainer(tmp_path, f"kills{seed}", max_failures=4)
    box = {}
    run = threading.Thread(target=lambda: box.setdefault("result", t.fit()))
    run.start()
    kills = kill_at(ray_session, t, run, kill_steps, seed, lambda: latest_step(tmp_path, f"kills{seed}"))
    run.join(300)
    result = box["result"]
    assert result.failures == 4 and len(result.world_sizes) == 5, (kills, result.events)
    got = steps_received(result)
    assert sorted(set(got)) == list(range(1, STEPS + 1)), (kills, got)  # none lost
    assert steps_applied(result) == list(range(1, STEPS + 1)), (kills, got)  # none twice


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_lost_right_after_the_final_checkpoint_loses_no_record(ray_session, tmp_path, rank):
    plain = trainer(tmp_path, "plain").fit()
    fault = {"generation": 0, "rank": rank, "step": "final", "kind": "exit"}
    result = trainer(tmp_path, f"final{rank}", fault=fault, max_failures=1).fit()
    assert result.failures == 1 and result.world_sizes == [2, 2], result.events
    assert sorted(set(steps_received(result))) == list(range(1, STEPS + 1))
    assert steps_applied(result) == list(range(1, STEPS + 1))
    assert any("finished with no step reported" in e or "finished at step" in e for e in result.events)
    for k, v in result.value.items():  # the resumed group only evaluated: the same weights
        assert torch.equal(v, plain.value[k]), k
