"""ElasticTrainer on a real local Ray with CPU workers (gloo): parity, lost, frozen, too many failures.

Each worker holds one "slot" of the session's two (see conftest), so a test can take a slot
away (a placeholder actor) to make the cluster too small to replace a lost worker.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig, TrainingFailedError
from tests.cluster import trainfns
from tests.distributed import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
STEPS = 12
SLOT = {"CPU": 1, "slot": 1}
FAST = dict(collective_timeout_s=8.0, heartbeat_timeout_s=30.0, start_timeout_s=30.0,
            grow_check_interval_s=1.0)


def fit(tmp_path, name: str, fault=None, min_workers=2, max_workers=2, max_failures=2, spares=0, **kw):
    fn = lambda ctx: trainfns.train_mlp(ctx, steps=STEPS, fault=fault, **kw)  # noqa: E731
    trainer = ElasticTrainer(fn, ScalingConfig(min_workers=min_workers, max_workers=max_workers,
                                               resources_per_worker=SLOT if not spares else {"CPU": 1},
                                               spare_workers=spares),
                             FailureConfig(max_failures=max_failures, **FAST),
                             storage_path=str(tmp_path), run_name=name)
    return trainer, trainer.fit


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _, run = fit(tmp, "plain")
    return run()


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_ray_workers_equal_the_plain_process_group_run(uninterrupted, tmp_path) -> None:
    out = tmp_path / "ref.pt"
    spawn.run(trainfns.reference, 2, str(tmp_path), str(out), STEPS, timeout_s=60)
    assert uninterrupted.world_sizes == [2] and uninterrupted.failures == 0
    assert [r["step"] for r in uninterrupted.records] == list(range(1, STEPS + 1))
    assert_bitwise(uninterrupted.value, torch.load(out, weights_only=True))


def test_a_warm_spare_replaces_a_lost_worker_and_is_started_again(uninterrupted, tmp_path) -> None:
    # The spare takes a CPU beside the two workers (not a 'slot': the session has two).
    fault = {"generation": 0, "rank": 1, "step": 5, "kind": "exit"}
    trainer, run = fit(tmp_path, "spare", fault=fault, spares=1)
    result = run()
    assert result.failures == 1 and result.world_sizes == [2, 2], result.events
    assert "1 warm spare(s) joined" in result.events, result.events
    assert_bitwise(result.value, uninterrupted.value)


def test_worker_exit_is_replaced_and_run_is_bitwise_equal(uninterrupted, tmp_path) -> None:
    fault = {"generation": 0, "rank": 1, "step": 5, "kind": "exit"}
    _, run = fit(tmp_path, "exit", fault=fault)
    result = run()
    assert result.failures == 1 and result.world_sizes == [2, 2], result.events
    assert any("worker 1 lost" in e for e in result.events), result.events
    assert_bitwise(result.value, uninterrupted.value)


def test_killed_worker_shrinks_then_grows_back(ray_session, uninterrupted, tmp_path) -> None:
    ray = ray_session
    trainer, run = fit(tmp_path, "shrink", min_workers=1, step_delay=0.3)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("result", run()))
    t.start()
    hog = _kill_one_when_stepping(ray, trainer)
    # the run goes on at one worker; give the slot back and it grows to two again
    _wait(lambda: 1 in _sizes(trainer), 60)
    ray.kill(hog)
    t.join(300)
    result = box["result"]
    assert result.world_sizes[:3] == [2, 1, 2], result.events
    assert result.records[-1]["step"] == STEPS
    steps = [r["step"] for r in result.records]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))  # every step done (replays allowed)
    for k, v in result.value.items():  # same data per step at every size: equal up to rounding
        assert torch.allclose(v, uninterrupted.value[k], rtol=1e-4, atol=1e-5), k


def test_frozen_worker_is_killed_and_replaced(uninterrupted, tmp_path) -> None:
    fault = {"generation": 0, "rank": 1, "step": 5, "kind": "freeze"}
    _, run = fit(tmp_path, "frozen", fault=fault)
    t0 = time.monotonic()
    result = run()
    assert result.failures == 1 and result.world_sizes == [2, 2], result.events
    assert_bitwise(result.value, uninterrupted.value)
    assert time.monotonic() - t0 < 120


def test_more_failures_than_allowed_stop_with_checkpoints_intact(ray_session, tmp_path) -> None:
    fault = {"generation": 0, "rank": 1, "step": 5, "kind": "exit"}
    _, run = fit(tmp_path, "fail", fault=fault, max_failures=0)
    with pytest.raises(TrainingFailedError, match="max_failures=0"):
        run()
    ckpts = tmp_path / "fail" / "checkpoints"
    assert (ckpts / "latest").exists()


def test_failure_right_after_recovery_ends_with_a_clear_error(ray_session, tmp_path) -> None:
    """A second loss as soon as the re-formed group resumes (step 4, its checkpoint) exhausts
    max_failures=1: the run stops with the count, and the checkpoints stay loadable."""
    faults = [{"generation": 0, "rank": 1, "step": 5, "kind": "exit"},
              {"generation": 1, "rank": 0, "step": 4, "kind": "exit"}]
    _, run = fit(tmp_path, "twice", fault=faults, max_failures=1)
    with pytest.raises(TrainingFailedError, match=r"2 failures exceed failure.max_failures=1"):
        run()
    import hybrid_ray
    engine, _, _, _ = hybrid_ray.initialize(trainfns._model(), config={
        "train_micro_batch_size_per_gpu": 12, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    path, _ = engine.load_checkpoint(str(tmp_path / "twice" / "checkpoints"))
    assert path is not None and engine.global_steps == 4


# ---- helpers ----------------------------------------------------------------------------
def _sizes(trainer) -> list:
    return trainer.controller.result.world_sizes if trainer.controller else []


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.2)


def _kill_one_when_stepping(ray, trainer):
    """Once step 4 is done, queue a placeholder for a slot, then kill worker 1: the freed slot
    goes to the placeholder, so the group must shrink. Returns the placeholder."""
    _wait(lambda: trainer.controller is not None and trainer.controller._last_step >= 4, 120)

    @ray.remote(num_cpus=0, resources={"slot": 1})
    class Hog:
        def ping(self):
            return True
    hog = Hog.remote()
    victim = trainer.controller.group.members[1]
    ray.kill(victim.handle, no_restart=True)
    ray.get(hog.ping.remote(), timeout=30)
    return hog
