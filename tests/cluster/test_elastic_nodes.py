"""Nodes joining and leaving a multi-node Ray cluster (ray.cluster_utils.Cluster: several raylets
on this machine, each a real node to Ray): the group grows when a node joins and shrinks when
one goes away with its worker."""
from __future__ import annotations

import os
import threading
import time

import cloudpickle
import pytest
import torch

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
from hybrid_ray.cluster.local import LOOPBACK
from tests.cluster import trainfns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
STEPS = 14
SLOT = {"CPU": 1, "slot": 1}


@pytest.fixture
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from hybrid_ray.cluster.local import cluster_of_one
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cloudpickle.register_pickle_by_value(trainfns)
    with cluster_of_one():  # every node the test adds registers on loopback, as local use does
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"slot": 2},
                                                           "include_dashboard": False})
        ray.init(address=c.address, log_to_driver=False)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
        yield c
        ray.shutdown()
        c.shutdown()


def start(tmp_path, min_workers: int, max_workers: int, hold_at: tuple):
    # hold_at: the resize each test makes must happen before the run ends, however long a
    # loaded machine takes to start a node: once the group of 2 finished its 14 steps as the
    # driver grew it, and the group of 3 found nothing left to train
    fn = lambda ctx: trainfns.train_mlp(ctx, steps=STEPS, step_delay=0.3, hold_at=hold_at)  # noqa: E731
    trainer = ElasticTrainer(fn, ScalingConfig(min_workers=min_workers, max_workers=max_workers,
                                               resources_per_worker=SLOT),
                             FailureConfig(max_failures=3, collective_timeout_s=8.0, start_timeout_s=30.0,
                                           grow_check_interval_s=1.0),
                             storage_path=str(tmp_path), run_name="nodes")
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    thread.start()
    return trainer, thread, box


def wait_for(cond, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_group_grows_when_a_node_joins(cluster, tmp_path) -> None:
    trainer, thread, box = start(tmp_path, min_workers=2, max_workers=3, hold_at=((6, 3),))
    wait_for(lambda: trainer.controller is not None and trainer.controller._last_step >= 3)
    cluster.add_node(num_cpus=1, resources={"slot": 1})
    thread.join(300)
    result = box["result"]
    import ray
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
    assert result.world_sizes[:2] == [2, 3], result.events
    assert result.failures == 0, result.events
    assert any("growing from 2 to 3" in e for e in result.events), result.events
    assert result.records[-1] == {**result.records[-1], "step": STEPS, "world_size": 3}, result.events


def test_group_shrinks_when_a_node_goes_and_grows_when_it_returns(cluster, tmp_path) -> None:
    extra = cluster.add_node(num_cpus=1, resources={"slot": 1})
    # the head holds 2 slots; take one so the second worker must land on the extra node
    import ray

    @ray.remote(num_cpus=0, resources={"slot": 1})
    class Hog:
        def ping(self):
            return True
    hog = Hog.remote()
    ray.get(hog.ping.remote())
    trainer, thread, box = start(tmp_path, min_workers=1, max_workers=2, hold_at=((6, 1), (10, 2)))
    wait_for(lambda: trainer.controller is not None and trainer.controller._last_step >= 4)
    cluster.remove_node(extra, allow_graceful=False)
    wait_for(lambda: 1 in trainer.controller.result.world_sizes)
    cluster.add_node(num_cpus=1, resources={"slot": 1})
    thread.join(300)
    result = box["result"]
    assert result.world_sizes[:3] == [2, 1, 2], result.events
    assert result.records[-1] == {**result.records[-1], "step": STEPS, "world_size": 2}, result.events
    assert torch.isfinite(torch.stack([v.float().sum() for v in result.value.values()])).all()
