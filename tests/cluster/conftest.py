"""A real local Ray for the cluster tests: one session per module, loopback only, no auth."""
from __future__ import annotations

import os

import cloudpickle
import pytest

from hybrid_ray.cluster.local import start_local
from tests.cluster import trainfns


@pytest.fixture(scope="module")
def ray_session():
    import ray
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Workers import hybrid_ray from the installed package; the test's own functions travel
    # by value (they live under tests/, which workers cannot import).
    cloudpickle.register_pickle_by_value(trainfns)
    # 4 logical CPUs on a 2-core machine: each worker takes 1 and trains with 1 thread.
    start_local(num_cpus=4, resources={"slot": 2}, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
