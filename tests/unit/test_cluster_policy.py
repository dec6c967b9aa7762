"""Scaling and failure policies and the cluster configs, without Ray."""
from __future__ import annotations

import pytest

from hybrid_ray.config.cluster import ClusterConfigError, FailureConfig, ScalingConfig
from hybrid_ray.cluster.policy import FailurePolicy, ScalingPolicy, stalled
from hybrid_ray.cluster.status import Member, replica_mates


def test_initial_size_takes_what_fits_up_to_max_and_waits_below_min() -> None:
    p = ScalingPolicy(ScalingConfig(min_workers=2, max_workers=4))
    assert p.initial(8).size == 4
    assert p.initial(3).size == 3
    d = p.initial(1)
    assert d.size is None and "min_workers is 2" in d.reason


def test_after_loss_keeps_survivors_adds_replacements_and_refuses_below_min() -> None:
    p = ScalingPolicy(ScalingConfig(min_workers=2, max_workers=4))
    assert p.after_loss(survivors=3, can_add=0).size == 3
    assert p.after_loss(survivors=3, can_add=5).size == 4
    assert p.after_loss(survivors=1, can_add=1).size == 2
    assert p.after_loss(survivors=1, can_add=0).size is None


def test_growth_only_with_room_and_never_past_max() -> None:
    p = ScalingPolicy(ScalingConfig(min_workers=1, max_workers=3))
    assert p.growth(2, 0).size is None
    assert p.growth(2, 4).size == 3
    assert p.growth(3, 4).size is None


def test_failure_budget() -> None:
    assert FailurePolicy(FailureConfig(max_failures=2)).may_recover(2).size == 1
    d = FailurePolicy(FailureConfig(max_failures=2)).may_recover(3)
    assert d.size is None and "max_failures=2" in d.reason
    assert FailurePolicy(FailureConfig(max_failures=-1)).may_recover(1000).size == 1


def test_stalled() -> None:
    assert not stalled(last_progress=100.0, now=129.0, timeout_s=30.0)
    assert stalled(last_progress=100.0, now=131.0, timeout_s=30.0)


@pytest.mark.parametrize("kwargs, key", [
    (dict(min_workers=0), "scaling.min_workers"),
    (dict(min_workers=3, max_workers=2), "scaling.max_workers"),
    (dict(placement_strategy="RANDOM"), "scaling.placement_strategy"),
    (dict(resources_per_worker={"GPU": -1}), "scaling.resources_per_worker.GPU"),
])
def test_bad_scaling_names_the_key(kwargs, key) -> None:
    with pytest.raises(ClusterConfigError, match=key.replace(".", r"\.")):
        ScalingConfig(**kwargs)


def test_bad_failure_names_the_key() -> None:
    with pytest.raises(ClusterConfigError, match=r"failure\.heartbeat_timeout_s"):
        FailureConfig(heartbeat_timeout_s=0)
    with pytest.raises(ClusterConfigError, match=r"failure\.max_failures"):
        FailureConfig(max_failures=-2)


def test_worker_resources_default_cpu_and_gpu() -> None:
    assert ScalingConfig().worker_resources() == {"CPU": 1.0}
    assert ScalingConfig(use_gpu=True).worker_resources() == {"CPU": 1.0, "GPU": 1.0}


def test_a_group_of_split_replicas_is_always_whole_replicas():
    policy = ScalingPolicy(ScalingConfig(min_workers=2, max_workers=6, replica_size=2))
    assert policy.initial(can_host=5).size == 4  # 2 replicas of 2; the fifth worker would be half one
    assert policy.initial(can_host=1).size is None
    assert policy.after_loss(survivors=2, can_add=1).size == 2  # one replica left, no room for another
    assert policy.after_loss(survivors=2, can_add=2).size == 4
    assert policy.growth(size=4, can_add=1).size is None and policy.growth(size=4, can_add=3).size == 6
    with pytest.raises(ClusterConfigError, match=r"^scaling.max_workers: not whole replicas; got 5; "
                       r"allowed: a multiple of replica_size \(2\)"):
        ScalingConfig(min_workers=2, max_workers=5, replica_size=2)


def test_a_lost_worker_takes_its_replica_mates_with_it():
    members = [Member(None, i, replica=i // 2) for i in range(4)]
    assert replica_mates(members, [members[1]]) == [members[0]]
    alone = [Member(None, i) for i in range(3)]  # replica_size 1: every worker its own replica
    assert replica_mates(alone, [alone[1]]) == []


def test_ranks_alternate_nodes_so_a_shard_and_its_copy_never_share_one() -> None:
    from hybrid_ray.cluster.policy import rank_order
    from hybrid_ray.cluster.status import Member

    nodes = ["a", "a", "a", "b", "b", "c"]
    members = [Member(None, i, {"node_id": n}) for i, n in enumerate(nodes)]
    order = [m.info["node_id"] for m in rank_order(members)]
    assert order == ["a", "b", "c", "a", "b", "a"]
    # rank r's buddy is r+1 (mod N): only where one node holds more than half can they meet
    pairs = [(order[r], order[(r + 1) % len(order)]) for r in range(len(order))]
    assert sum(x == y for x, y in pairs) == 1
    assert rank_order(members, replica_size=2) == members  # whole replicas keep their order
