"""The local Ray cluster that hybrid_ray starts (a job without a cluster address, and these tests'
session) is on loopback: the node registers at 127.0.0.1, so do the workers (whose address becomes
the gloo rendezvous), and no Ray process listens anywhere else; the switch that does it is not
left behind for a later ray.init(address=...) of the same process."""
from __future__ import annotations

import os

import psutil
import pytest
from ray._private import ray_constants

from hybrid_ray.cluster.worker import Worker
from tests.cluster.netcheck import listening_off_loopback

pytestmark = pytest.mark.slow


def test_the_local_cluster_and_its_workers_are_on_loopback(ray_session):
    ray = ray_session
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    actors = [ray.remote(Worker).options(num_cpus=1).remote() for _ in range(2)]
    infos = ray.get([a.info.remote() for a in actors], timeout=120)
    assert {i["ip"] for i in infos} == {"127.0.0.1"}
    port = ray.get(actors[0].free_port.remote(), timeout=60)
    assert 1024 <= port < 65536
    ray_processes = psutil.Process().children(recursive=True)
    assert len(ray_processes) >= 4  # GCS, raylet, agents, the two workers
    assert not listening_off_loopback(ray_processes)
    for a in actors:
        ray.kill(a)


def test_the_switch_is_put_back_after_the_start(ray_session):
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    assert ray_constants.ENABLE_RAY_CLUSTER is True
