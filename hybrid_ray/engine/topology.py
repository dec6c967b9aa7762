"""Who this process is and which process group its data-parallel traffic uses.

The topology travels as one explicit object (like torchtitan's ParallelDims) instead of module
globals, so the Ray layer can build a fresh one for every membership change.
"""
from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """The data-parallel layout of one process.

    rank/world_size: this process's place in the data-parallel group.
    device: where the model and its flat buffers live.
    group: the process group for data-parallel collectives (None when world_size == 1 and no
      group exists; the engine then runs without any collective).
    abort: set by whoever tears the group down (the Ray worker, when a peer is lost): waits that
      depend on the other ranks, such as a checkpoint commit, end at once instead of timing out.
    """

    rank: int
    world_size: int
    device: torch.device
    group: Optional[dist.ProcessGroup] = None
    abort: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

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
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        return cls(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD)


def _default_device() -> torch.device:
    """cuda:LOCAL_RANK when a GPU is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")
