"""Buddy replicas on a CUDA device: the shard's copy to pinned host memory runs on a side stream
after the step's kernels, and the next update waits for it on the device, not the host.

One rank (no buddy to send to: this is the copy a GPU adds); skipped where no GPU is present."""
from __future__ import annotations

import pytest
import torch

from hybrid_ray.engine.replicas import KEEPER
from tests.gpu.test_cuda_engine import batch, engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("extra", [{}, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}],
                         ids=["device-masters", "offloaded-masters"])
def test_every_snapshot_equals_the_masters_of_its_step(extra) -> None:
    e = engine({"bf16": {"enabled": True}, "fault_tolerance": {"replicas": 1}, **extra})
    for step in range(4):
        e.backward(e(*batch(step)))
        e.step()
        e.replicas.wait()
        snap = KEEPER.get("own", e.global_steps)
        assert snap.tensors[0]["master"].is_pinned() or extra
        for live, copy in zip(e.zero.masters, snap.tensors):
            assert torch.equal(live.detach().cpu(), copy["master"])
            state = e.optimizer.state[live]
            assert torch.equal(state["exp_avg_sq"].cpu(), copy["exp_avg_sq"])
    e.destroy()


def test_replay_on_the_host_follows_the_device_update() -> None:
    # Replay mode at one rank has no buddy: stand in for one. A copy of the shard on the host,
    # stepped by the buddy's optimizer (built from the engine's spec, CPU kernel) with each
    # step's gradient, follows the device's fused CUDA update within rounding.
    from hybrid_ray.engine.replicas import replay, snapshot

    e = engine({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                "fault_tolerance": {"replicas": 1, "mode": "replay"}})
    e.backward(e(*batch(0)))
    e.step()  # the optimizer state exists from here on
    ts = e.train_state()
    copy = [{k: t.detach().cpu().clone() for k, t in ts_.items()} for ts_ in snapshot.shard_tensors(ts)]
    stepper = replay.Stepper(replay.optimizer_spec(ts), copy)
    apply = e.zero.apply

    def mirrored(update):
        if update is not None:  # what the buddy would receive, before the owner scales it
            grads = [g.detach().cpu().clone() for g in update.grads]
            hyper = replay.hyperparameters(update.optimizer)
            stepper.apply(replay.Pending(e.global_steps, grads, update.coef, hyper, b""))
        apply(update)
    e.zero.apply = mirrored
    for step in range(1, 4):
        e.backward(e(*batch(step)))
        e.step()
        live = KEEPER.get("own", e.global_steps)  # the live state, by reference: on the device
        assert live.tensors[0]["master"].device.type == "cuda"
        for master, held in zip(e.zero.masters, copy):
            assert torch.allclose(master.detach().cpu(), held["master"], rtol=0, atol=1e-6)
    e.destroy()


@pytest.mark.parametrize("offload", [None, {"device": "cpu", "ratio": 0.5}, {"device": "cpu"}],
                         ids=["device-masters", "half-offloaded", "offloaded-masters"])
def test_replay_on_the_device_steps_the_copy_bitwise_as_the_owner(offload) -> None:
    # replay_on device, with a stand-in buddy (one rank): the copy lies where each master lies,
    # steps with the owner's kernel on its own stream in another thread, after the event that
    # marks the gradients' arrival, and equals the owner's shard bit for bit after every step.
    import concurrent.futures as cf

    from hybrid_ray.engine.replicas import replay, snapshot

    zero = {"stage": 2, **({"offload_optimizer": offload} if offload else {})}
    e = engine({"bf16": {"enabled": True}, "zero_optimization": zero,
                "fault_tolerance": {"replicas": 1, "mode": "replay", "replay_on": "device"}})
    e.backward(e(*batch(0)))
    e.step()
    ts = e.train_state()
    copy = [{k: t.detach().clone() for k, t in ts_.items()} for ts_ in snapshot.shard_tensors(ts)]
    assert [c["master"].device for c in copy] == [m.device for m in e.zero.masters]
    stepper = replay.Stepper(replay.optimizer_spec(ts), copy, owners_kernel=True)
    assert stepper.stream is not None or offload == {"device": "cpu"}
    pool, apply, futures = cf.ThreadPoolExecutor(1), e.zero.apply, []

    def mirrored(update):
        if update is not None:  # what the buddy receives: the shard before the owner scales it
            grads = [g.detach().clone() for g in update.grads]
            pending = replay.Pending(e.global_steps, grads, update.coef, replay.hyperparameters(update.optimizer), b"")
            pending.mark_arrived()
            futures.append(pool.submit(stepper.apply, pending))
        apply(update)
    e.zero.apply = mirrored
    try:
        for step in range(1, 5):
            e.backward(e(*batch(step)))
            e.step()
            futures.pop().result()
            torch.cuda.synchronize()
            for master, held in zip(e.zero.masters, copy):
                assert torch.equal(master.detach(), held["master"]), step
                assert torch.equal(e.optimizer.state[master]["exp_avg_sq"], held["exp_avg_sq"]), step
    finally:
        pool.shutdown()
        e.destroy()


@pytest.mark.parametrize("extra", [{}, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}],
                         ids=["device-masters", "offloaded-masters"])
def test_copies_into_a_spares_shared_slots_equal_each_steps_shard(extra) -> None:
    # A lone worker with a warm spare on its node: the side stream's copies land in the slots
    # the spare shares (page-locked in this process), whole once the copy thread marks them.
    from hybrid_ray.engine.replicas import handoff

    KEEPER.clear()
    e = engine({"bf16": {"enabled": True}, "fault_tolerance": {"replicas": 1}, **extra})
    e.backward(e(*batch(0)))
    e.step()
    e.replicas.wait()
    with handoff.exported(-1) as copy:
        spec = handoff.slot_spec(copy)
    handoff.attach_slots(handoff.open_slots(spec), spec)
    try:
        assert KEEPER.slot_writer.pinned or extra
        for step in range(1, 5):
            e.backward(e(*batch(step)))
            e.step()
            e.replicas.wait()
            desc, held = handoff._SPARE_SLOTS.read()
            assert desc["step"] == e.global_steps
            for live, copy in zip(e.zero.masters, held):
                assert torch.equal(live.detach().cpu(), copy["master"])
                assert torch.equal(e.optimizer.state[live]["exp_avg_sq"].cpu(), copy["exp_avg_sq"])
    finally:
        e.destroy()
        handoff.detach_slots()
        handoff.close_slots()
        KEEPER.clear()
