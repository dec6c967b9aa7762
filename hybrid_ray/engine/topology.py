"""Who this process is and which process group its data-parallel traffic uses.

The topology travels as one explicit object (like torchtitan's ParallelDims) instead of module
globals, so the Ray layer can build a fresh one for every membership change.
"""
from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import lifecycle

if dist.is_available():
    # torch.distributed.nn.functional binds `group.WORLD` as a default argument at import. The
    # first torch optimizer imports it (through torch._dynamo); after init_process_group that
    # pins the world group until interpreter teardown, gloo's threads running on past
    # destroy_process_group(). Imported with this package, before a script starts its group,
    # those defaults are None.
    import torch.distributed.nn.functional  # noqa: F401


@dataclass(frozen=True)
class Topology:
    """The data-parallel layout of one process.

    rank/world_size: this process's place in the data-parallel group.
    device: where the model and its flat buffers live.
    group: the process group for data-parallel collectives (None when world_size == 1 and no
      group exists; the engine then runs without any collective).
    abort: set by whoever tears the group down (the Ray worker, when a peer is lost): waits that
      depend on the other ranks, such as a checkpoint commit, end at once instead of timing out.
    model_group: the other ranks that hold other parts of the same model replica (a pipeline's
      stages, its tensor-parallel shards), or None: the gradient norm (clipping, the overflow
      check) sums over it as well.
    mesh: the (pp, dp, tp) layout (engine/mesh.py ParallelMesh) when tensor parallelism or the
      config's pipeline_model_parallel_size placed the model, else None.
    """

    rank: int
    world_size: int
    device: torch.device
    group: Optional[dist.ProcessGroup] = None
    abort: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)
    model_group: Optional[dist.ProcessGroup] = field(default=None, compare=False, repr=False)
    mesh: Optional[Any] = field(default=None, compare=False, repr=False)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @classmethod
    def from_environment(cls, device: Optional[torch.device] = None,
                         timeout_s: float = 1800.0) -> "Topology":
        """Join (or create) the default process group from RANK/WORLD_SIZE/MASTER_ADDR.

        torchrun and our Ray workers both set these variables; a plain `python train.py` sets
        none and gets a single-process topology with no group at all.
        """
        device = device or _default_device()
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(0, 1, device, None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        gloo_on_loopback(os.environ.get("MASTER_ADDR", ""))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        lifecycle.created_default_group()
        return cls(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD)


def gloo_on_loopback(master_addr: str) -> None:
    """With the rendezvous on this machine's loopback, gloo's connections stay there too.

    Gloo binds to the interface GLOO_SOCKET_IFNAME names, else to the address the host name
    resolves to: on a machine whose name resolves to its network address, a local run would
    listen there and its traffic leave loopback. A user's GLOO_SOCKET_IFNAME is kept.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ or not _is_loopback(master_addr):
        return
    name = loopback_interface()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _is_loopback(addr: str) -> bool:
    return addr == "localhost" or addr.startswith("127.") or addr == "::1"


def loopback_interface() -> Optional[str]:
    """The name of the interface that holds 127.0.0.1 ('lo' on Linux, 'lo0' on macOS)."""
    import socket

    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _default_device() -> torch.device:
    """cuda:LOCAL_RANK when a GPU is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")
