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
    for v in (3, 4):
        k.put_own(snap(v))
        k.put_held(snap(v))
    k.commit(4)
    assert sorted(k.own) == [4] and sorted(k.held) == [4]
    k.put_own(snap(5))
    k.commit(5)
    assert k.recycled("own").step == 4 and k.recycled("own") is None
    k.start("/runs/other")  # another run in the same process: nothing of the first is kept
    assert not k.own and not k.held and k.committed == -1
