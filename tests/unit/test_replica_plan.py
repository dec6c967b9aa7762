"""The recovery plan from what each survivor's keeper holds (pure: no process group)."""
from __future__ import annotations

import torch

from hybrid_ray.engine.replicas import Keeper, Snapshot, plan

RUN = "/runs/a/checkpoints"


def summary(own: dict, held: dict, run: str = RUN, disk: int = -1) -> dict:
    """own/held: {version: old rank}, every snapshot taken in a group of 3."""
    return {"run": run, "disk_step": disk, "own": {v: (r, 3) for v, r in own.items()},
            "held": {v: (r, 3) for v, r in held.items()}}


def test_the_newest_version_held_for_every_old_rank_wins() -> None:
    # Old ranks 0, 1, 2; rank 2 was lost. Rank 0 holds its own 7 and 8 and rank 2's copy of 7
    # and 8 (its buddy is rank 0); rank 1 holds its own 7 and 8 and rank 0's copies.
    survivors = [summary({7: 0, 8: 0}, {7: 2, 8: 2}), summary({7: 1, 8: 1}, {7: 0, 8: 0})]
    p, why = plan(survivors, RUN)
    assert why == "ok" and p.step == 8 and p.world == 3
    assert p.sources == {0: (0, "own"), 1: (1, "own"), 2: (0, "held")}


def test_a_version_whose_copy_did_not_arrive_is_passed_over() -> None:
    # The copy of version 8 from rank 2 never reached rank 0: version 7 is the newest complete.
    survivors = [summary({7: 0, 8: 0}, {7: 2}), summary({7: 1, 8: 1}, {7: 0, 8: 0})]
    p, _ = plan(survivors, RUN)
    assert p.step == 7 and p.sources[2] == (0, "held")


def test_a_rank_lost_with_its_buddy_leaves_no_plan() -> None:
    p, why = plan([summary({8: 0}, {8: 2})], RUN)
    assert p is None and "lack rank(s) [1]" in why


def test_replicas_of_another_run_or_older_than_the_disk_are_not_used() -> None:
    survivors = [summary({8: 0}, {8: 2}), summary({8: 1}, {8: 0})]
    assert plan(survivors, "/runs/b/checkpoints")[0] is None
    p, why = plan([summary({8: 0}, {8: 2}, disk=9), summary({8: 1}, {8: 0})], RUN)
    assert p is None and "older than the newest checkpoint (step 9)" in why
    fresh = {"run": None, "disk_step": -1, "own": {}, "held": {}}  # a replacement process
    assert plan(survivors + [fresh], RUN)[0].sources[2] == (0, "held")


def snap(step: int) -> Snapshot:
    return Snapshot(step, 0, 2, [{"master": torch.zeros(4)}], b"", RUN)


def test_a_commit_drops_older_versions_and_offers_their_buffers() -> None:
    k = Keeper()
    k.start(RUN)
    token = k.begin()
    for v in (3, 4):
        k.put_own(snap(v), token)
        k.put_held(snap(v), token)
    k.commit(4, token)
    assert sorted(k.own) == [4] and sorted(k.held) == [4]
    k.put_own(snap(5), token)
    k.commit(5, token)
    assert k.recycled("own").step == 4 and k.recycled("own") is None
    k.start("/runs/other")  # another run in the same process: nothing of the first is kept
    assert not k.own and not k.held and k.committed == -1


def test_a_broken_groups_late_exchange_changes_nothing() -> None:
    # The old ring's exchange may still be blocked on a lost peer when the next group's engine
    # starts its own ring: whatever it delivers afterwards is ignored.
    k = Keeper()
    k.start(RUN)
    old = k.begin()
    k.put_own(snap(7), old)
    k.commit(7, old)
    new = k.begin()
    k.put_held(snap(8), old)
    k.commit(8, old)
    assert sorted(k.held) == [] and k.committed == 7
    k.put_own(snap(9), new)
    k.commit(9, new)
    assert sorted(k.own) == [9] and k.committed == 9


def test_the_next_rings_first_commit_drops_the_old_rings_versions() -> None:
    # A process that trained to step 8, recovered at step 8 and started a new ring: once the
    # new ring commits step 9, nothing of the old one is kept, and the new ring's low step
    # numbers are not dropped for being below the old ring's commit.
    k = Keeper()
    k.start(RUN)
    old = k.begin()
    for v in (7, 8):
        k.put_own(snap(v), old)
    k.commit(8, old)
    new = k.begin()
    k.put_own(snap(9), new)
    k.commit(9, new)
    assert sorted(k.own) == [9]
    again = k.begin()  # a third engine in the same process, from step 1 (a new run of the same folder)
    k.rewind(0)
    k.put_own(snap(1), again)
    k.commit(1, again)
    assert sorted(k.own) == [1]


def test_a_load_gives_up_the_versions_after_it() -> None:
    k = Keeper()
    k.start(RUN)
    t = k.begin()
    for v in (5, 6):
        k.put_own(snap(v), t)
        k.put_held(snap(v), t)
    k.rewind(5)
    assert sorted(k.own) == [5] and sorted(k.held) == [5]


def test_a_second_engine_in_the_process_keeps_its_own_snapshots() -> None:
    # One rank on the CPU (no buddy: the copy is committed at once). The second engine starts
    # from step 0 after the first reached step 3: its snapshots are kept, not dropped as older.
    from hybrid_ray.engine import Engine, Topology
    from hybrid_ray.engine.replicas import KEEPER

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1}, "fault_tolerance": {"replicas": 1}}
    for steps in (3, 2):
        torch.manual_seed(0)
        e = Engine(torch.nn.Linear(4, 4), cfg, topology=Topology(0, 1, torch.device("cpu")))
        for _ in range(steps):
            e.backward(e(torch.randn(2, 4)).square().mean())
            e.step()
            e.replicas.wait()
            got = KEEPER.get("own", e.global_steps).tensors[0]["master"]
            assert torch.equal(got, e.zero.masters[0].detach())
        e.destroy()
