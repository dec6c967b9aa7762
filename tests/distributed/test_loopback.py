"""Local runs keep their traffic on loopback: a gloo group formed at 127.0.0.1 has every one of
its sockets there, whatever address the host name resolves to."""
from __future__ import annotations

import os
import socket

import psutil
import pytest
import torch
import torch.distributed as dist

from hybrid_ray.engine.topology import gloo_on_loopback, loopback_interface
from tests.distributed import spawn

pytestmark = [pytest.mark.dist]


def sockets_after_a_collective(rank: int, world: int) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world
    inet = [c for c in psutil.Process().net_connections(kind="inet")
            if c.family == socket.AF_INET and c.laddr]
    assert inet, "gloo made no TCP socket"
    outside = [c for c in inet if not c.laddr.ip.startswith("127.")]
    assert not outside, f"rank {rank}: sockets off loopback: {outside}"
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()


def test_a_local_gloo_group_stays_on_loopback():
    spawn.run(sockets_after_a_collective, 2, timeout_s=60)


def test_the_loopback_pin_keeps_a_users_interface(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    gloo_on_loopback("10.0.0.5")  # a real cluster address: gloo's own choice stands
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    gloo_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface() != None  # noqa: E711
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    gloo_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
