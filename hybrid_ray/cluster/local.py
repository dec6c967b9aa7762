"""A Ray cluster of this machine only, on loopback.

Ray 2.60 does not keep a local cluster on 127.0.0.1 when asked: `ray.init(_node_ip_address=
"127.0.0.1")` and `ray start --node-ip-address 127.0.0.1` both pass the address through
`services.resolve_ip_for_localhost`, which swaps a loopback address for the host's routable one,
so the raylet, the object manager and every worker register (and gloo rendezvous) on the outward
interface. The one switch Ray has for "this node is not part of a wider cluster" is
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: with it the node address resolves to 127.0.0.1. Ray reads it
twice: once at import into `ray_constants.ENABLE_RAY_CLUSTER` (the driver's resolution, here
already imported), and from the environment of each process it spawns (GCS, raylet, workers).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import ray
from ray._private import ray_constants

LOOPBACK = "127.0.0.1"
_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def cluster_of_one() -> Iterator[None]:
    """Ray believes it forms no cluster while the block runs; everything is put back after.
    Nodes started inside it (ray.init, or ray.cluster_utils.Cluster's several raylets of one
    machine) register on 127.0.0.1.

    Only the start needs it: once a session runs, Ray answers the node address from the session,
    and the processes it spawned keep the environment they were started with. Putting it back
    matters for a later ray.init(address=...) in the same process, which must find its own
    routable address to join a real cluster."""
    had_env, had_const = os.environ.get(_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = had_const
        if had_env is None:
            os.environ.pop(_SWITCH, None)
        else:
            os.environ[_SWITCH] = had_env


def start_local(**init_kwargs) -> None:
    """ray.init() of a new one-node cluster whose node, workers and ports are on 127.0.0.1."""
    with cluster_of_one():
        ray.init(address="local", _node_ip_address=LOOPBACK, **init_kwargs)
