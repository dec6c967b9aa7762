"""A lone worker's copies in slots shared with its warm spare (engine/replicas/slots.py), without
Ray: one process plays both sides (the spare's slots, the worker's engine), the copy in the
slots equals the engine's shard after every step, a new engine recovers from the adopted copy
without reading a checkpoint, and a writer killed between any two of its writes leaves the
spare a whole copy (the previous one or the new one, never a mix)."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hybrid_ray.engine import Engine
from hybrid_ray.engine.replicas import KEEPER, Keeper, handoff, plan
from hybrid_ray.engine.replicas import slots as sl
from hybrid_ray.engine.replicas.snapshot import Snapshot

D = 16


def engine(mode: str = "copy") -> Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.LayerNorm(D))
    return Engine(model, {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                          "zero_optimization": {"stage": 2, "reduce_bucket_size": 100},
                          "fault_tolerance": {"replicas": 1, "mode": mode}})


def step(e: Engine) -> None:
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(e.global_steps))
    e.backward(e(x).pow(2).mean())
    e.step()


def shard(e: Engine) -> torch.Tensor:
    return torch.cat([m.detach().reshape(-1) for m in e.zero.masters]
                     + [v.reshape(-1) for m in e.zero.masters for _, v in sorted(e.optimizer.state[m].items())
                        if torch.is_tensor(v) and v.shape == m.shape])


@pytest.fixture
def clean():
    KEEPER.clear()
    yield
    handoff.want_copies(False)
    handoff.detach_slots()
    handoff.close_slots()
    KEEPER.clear()


def share(e: Engine) -> None:
    """What the cluster layer does after the first push: the spare opens slots, the worker maps them."""
    with handoff.exported(-1) as copy:
        spec = handoff.slot_spec(copy)
    handoff.attach_slots(handoff.open_slots(spec), spec)


@pytest.mark.parametrize("mode", ["copy", "replay"])
def test_the_slots_hold_the_engines_shard_after_every_step(tmp_path: Path, clean, mode: str) -> None:
    e = engine(mode)
    e.save_checkpoint(str(tmp_path))  # names the run
    step(e)
    e.replicas.wait()
    assert handoff.newest_step() == (-1 if mode == "replay" else 1)  # replay at one rank: only for spares
    handoff.want_copies(True)  # a warm spare (the cluster layer's set_spares)
    step(e)
    e.replicas.wait()
    assert handoff.newest_step() == 2
    share(e)
    for _ in range(4):
        step(e)
        e.replicas.wait()
        desc, tensors = handoff._SPARE_SLOTS.read()  # the spare's view
        assert desc["step"] == e.global_steps and desc["rank"] == 0 and desc["world"] == 1
        assert torch.equal(torch.cat([t.reshape(-1) for ts in tensors for t in ts.values()]), shard(e))
        assert handoff.import_copy(None) == e.global_steps  # what the spare says it holds
    assert handoff.newest_step() == 2  # no own host copy since the slots: nothing to push
    e.destroy()


def test_a_spare_recovers_from_the_adopted_copy_without_reading_a_checkpoint(tmp_path: Path, clean) -> None:
    e = engine()
    e.save_checkpoint(str(tmp_path))
    step(e)
    e.replicas.wait()
    share(e)
    for _ in range(3):
        step(e)
    e.replicas.wait()
    want, at = shard(e), e.global_steps
    e.destroy()
    handoff.detach_slots()
    KEEPER.clear()  # the worker's process is gone: only the spare's slots are left
    assert handoff.adopt_slots() == at
    p, why = plan([KEEPER.summary()], KEEPER.run)
    assert why == "ok" and p.step == at
    spare = engine()
    spare.load_checkpoint(str(tmp_path))
    assert spare.global_steps == at and spare.replicas.last_recovery["source"] == "memory"
    assert torch.equal(shard(spare), want)
    spare.destroy()


def test_a_writer_is_refused_a_changed_layout_and_nothing_after_close() -> None:
    live = [{"master": torch.arange(6.0)}]
    spare = sl.Slots.create(sl.spec_of(sl.entries(live), 10))
    writer = sl.SlotWriter(sl.Slots.attach(spare.path, spare.spec), pin=False)
    spare.unlink()
    assert writer.begin([{"master": torch.arange(7.0)}]) is None
    assert writer.begin([{"master": torch.arange(6.0, dtype=torch.float64)}]) is None
    i, views = writer.begin(live)
    writer.end()
    writer.close()
    assert writer.begin(live) is None
    assert not os.path.exists(spare.path)


# ---- a writer killed between any two of its writes --------------------------------------
def _write_and_die(path: str, spec: dict, die_at: int, ready) -> None:
    """Child: write step 1 whole, then step 2 with a kill at the `die_at`-th line executed in the
    copy's code (slots.py and the snapshot's copy), or not at all."""
    from hybrid_ray.engine.replicas import snapshot as snap
    writer = sl.SlotWriter(sl.Slots.attach(path, spec), pin=False)
    for s in (1, 2):
        live = [{"master": torch.full((40,), float(s)), "exp_avg": torch.full((9,), -float(s))}]
        if s == 2:
            seen = [0]
            watched = {sl.__file__, snap.__file__}

            def tracer(frame, event, arg):
                if frame.f_code.co_filename not in watched:
                    return None
                if event == "line":
                    seen[0] += 1
                    if seen[0] == die_at:
                        os._exit(7)
                return tracer
            sys.settrace(tracer)
        i, views = writer.begin(live)
        snap.copy_into(live, views, False)
        writer.finish(i, Snapshot(s, 0, 1, views, b"x" * (10 * s), "/run"), -1)
        writer.end()
        sys.settrace(None)
        if s == 1:
            ready.set()
    os._exit(0)


def test_a_writer_killed_between_any_two_writes_leaves_a_whole_copy() -> None:
    live = [{"master": torch.zeros(40), "exp_avg": torch.zeros(9)}]
    ctx = mp.get_context("fork")
    die_at, outcomes = 1, set()
    while True:
        spare = sl.Slots.create(sl.spec_of(sl.entries(live), 20))
        ready = ctx.Event()
        child = ctx.Process(target=_write_and_die, args=(spare.path, spare.spec, die_at, ready))
        child.start()
        child.join(30)
        assert ready.is_set() and child.exitcode in (0, 7)
        desc, tensors = spare.read()
        s = desc["step"]
        assert s in (1, 2) and desc["small"] == b"x" * (10 * s)
        assert torch.equal(tensors[0]["master"], torch.full((40,), float(s)))
        assert torch.equal(tensors[0]["exp_avg"], torch.full((9,), -float(s)))
        outcomes.add((child.exitcode, s))
        spare.unlink()
        if child.exitcode == 0:
            break
        die_at += 1
    assert die_at > 10 and outcomes >= {(7, 1), (0, 2)}  # every point up to a whole write was tried


def test_leftover_slot_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "hybrid_ray-slots-999999999-abc"
    dead.write_bytes(b"0")
    mine = sl.Slots.create(sl.spec_of([[("master", "float32", 4)]], 1), str(tmp_path))
    assert not dead.exists() and os.path.exists(mine.path)
    mine.unlink()


def test_a_spare_keeps_a_pushed_copy_newer_than_its_slots(clean) -> None:
    live = [{"master": torch.zeros(4)}]
    path = handoff.open_slots(sl.spec_of(sl.entries(live), 10))
    keeper = Keeper()
    keeper.keep_copy(Snapshot(9, 0, 1, [{"master": torch.ones(4)}], b"s", "/run"))
    writer = sl.SlotWriter(sl.Slots.attach(path, handoff._SPARE_SLOTS.spec), pin=False)
    i, views = writer.begin(live)
    writer.finish(i, Snapshot(5, 0, 1, views, b"s", "/run"), -1)
    writer.end()
    assert handoff.adopt_slots(keeper) == -1 and sorted(keeper.held) == [9]


def test_the_benchmarks_loopback_buddy_steps_its_copy_bitwise_as_the_engine() -> None:
    # jobs/replay_loop.py stands in for a buddy at one rank (the replay-gpu1 suite times it):
    # what it times must be the buddy's real work, so its copy must follow the engine exactly.
    from tests.jobs_scripts import load_script
    loop = load_script("replay_loop")
    e = engine("replay")
    box = loop.loopback_buddy(e)
    for _ in range(5):
        step(e)
    box["fut"].result()
    assert all(torch.equal(p.detach(), m.detach()) for p, m in zip(box["stepper"].params, e.zero.masters))
    e.destroy()


def _write_forever(path: str, spec: dict, wrote) -> None:
    """Child: a writer whose driver never killed it (hung, then woken): copies on and on."""
    from hybrid_ray.engine.replicas import snapshot as snap
    writer = sl.SlotWriter(sl.Slots.attach(path, spec), pin=False)
    s = 0
    while True:
        s += 1
        live = [{"master": torch.full((40,), float(s))}]
        i, views = writer.begin(live)
        snap.copy_into(live, views, False)
        writer.finish(i, Snapshot(s, 0, 1, views, b"x", "/run"), -1)
        writer.end()
        wrote.set()


def test_a_copy_adopted_while_its_writer_lives_on_is_kept_apart_or_refused(clean) -> None:
    live = [{"master": torch.zeros(40)}]
    path = handoff.open_slots(sl.spec_of(sl.entries(live), 10))
    ctx = mp.get_context("fork")
    wrote = ctx.Event()
    child = ctx.Process(target=_write_forever, args=(path, handoff._SPARE_SLOTS.spec, wrote), daemon=True)
    child.start()
    try:
        assert wrote.wait(30)
        slots = handoff._SPARE_SLOTS
        desc, tensors = slots.read()
        kept = sl.settled(slots, desc, tensors, wait_s=0.2)
        if kept is not None:  # a private copy of that step: the writer cannot change it
            assert kept[0]["master"].data_ptr() != tensors[0]["master"].data_ptr()
            assert torch.equal(kept[0]["master"], torch.full((40,), float(desc["step"])))
    finally:
        child.kill()
        child.join(10)
    desc, tensors = slots.read()  # its writer is gone now: kept as it is, no copy
    assert sl.settled(slots, desc, tensors, wait_s=0.2) is tensors
