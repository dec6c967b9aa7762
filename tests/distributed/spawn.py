"""Run a function in N real processes joined by a gloo process group (CPU)."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple,
           timeout_s: Optional[float]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N processes share 2 cores: avoid oversubscription
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, world, *args)
        # gloo returns from a collective once this rank has its data, while a peer may still be
        # receiving from it; tearing the group down then aborts the peer. Leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fn: Callable, world: int, *args: Any, timeout_s: Optional[float] = None) -> None:
    """Spawn `world` processes running fn(rank, world, *args); re-raise the first failure.

    timeout_s bounds each collective: ranks that disagree (one skips a step the other takes)
    then fail with a gloo timeout instead of hanging until pytest's own timeout.
    """
    mp.start_processes(_entry, args=(fn, world, free_port(), args, timeout_s), nprocs=world,
                       start_method="spawn", join=True)
