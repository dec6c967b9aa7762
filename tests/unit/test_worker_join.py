"""A worker's rendezvous without Ray: a group that failed to form leaves nothing that renames the
next one (seen under repeated kills: a survivor's next group waited under another name than its
fresh peer's until the timeout)."""
from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from hybrid_ray.cluster.worker import _forget_failed_groups


def test_a_failed_rendezvous_does_not_rename_the_next_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception):  # rank 1 never comes: the group cannot form
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=1))
    assert not dist.is_initialized()
    assert dist.distributed_c10d._world.group_count == 1  # torch's counter moved on anyway
    _forget_failed_groups()
    assert dist.distributed_c10d._world.group_count == 0  # the next group is named as its peers'
