"""Run a function in N real processes joined by a process group: gloo on CPU, NCCL on GPUs."""
from __future__ import annotations

import datetime
import os
import random
import socket
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_ray.engine.topology import gloo_on_loopback


_USED: set = set()


def rendezvous_port() -> int:
    """A port below the kernel's ephemeral range, never handed out twice here: a port that
    free_port() frees comes from that range, and 100 processes' own sockets can take it before
    rank 0's store binds it (seen once: rank 1 hung connecting to a store that never started)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.SystemRandom()
    while True:
        port = pick.randrange(10000, low)
        if port in _USED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _USED.add(port)
        return port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Each spawned rank would import torch and the engine again (about 3.5 s of CPU each: 14 s of an
# 8-rank test on 2 cores). A fork server imports them once per test session; its children fork
# from it with the imports done. They start from the server's environment and folder, not the
# caller's, so _entry restores the caller's (a test's monkeypatched MLFLOW_TRACKING_URI, chdir).
_PRELOAD = ["torch", "torch.distributed", "hybrid_ray", "hybrid_ray.engine", "tests.distributed.spawn"]
mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
START_METHOD = "forkserver"


def caller_state() -> tuple:
    return dict(os.environ), os.getcwd()


def _restore(state: Optional[tuple]) -> None:
    if state is None:
        return
    env, cwd = state
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple,
           timeout_s: Optional[float], backend: str, state: Optional[tuple] = None) -> None:
    _restore(state)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    gloo_on_loopback("127.0.0.1")  # gloo's own sockets too, not the host name's address
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    device = None
    if backend == "nccl":  # one GPU per rank
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # N processes share 2 cores: avoid oversubscription
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, device_id=device)
    try:
        fn(rank, world, *args)
        # gloo returns from a collective once this rank has its data, while a peer may still be
        # receiving from it; tearing the group down then aborts the peer. Leave together.
        # fn(rank, world, *args) finds its device as cuda:rank under NCCL.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fn: Callable, world: int, *args: Any, timeout_s: Optional[float] = None,
        backend: str = "gloo") -> None:
    """Spawn `world` processes running fn(rank, world, *args); re-raise the first failure.

    timeout_s bounds each collective: ranks that disagree (one skips a step the other takes)
    then fail with a gloo timeout instead of hanging until pytest's own timeout.
    """
    mp.start_processes(_entry, args=(fn, world, free_port(), args, timeout_s, backend, caller_state()),
                       nprocs=world, start_method=START_METHOD, join=True)


def save_result(out: str, rank: int, result: Any) -> None:
    """A rank's results, for `results` to read back in the test process."""
    torch.save(result, Path(out) / f"rank{rank}.pt")


def results(out: str, world: int) -> list:
    """What each rank passed to `save_result`, in rank order."""
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
