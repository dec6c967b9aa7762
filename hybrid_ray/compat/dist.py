"""`deepspeed.comm` and `deepspeed.init_distributed` over torch.distributed.

The collectives keep torch's signatures. Without a process group (one plain `python train.py`)
they act as the only rank of a world of one, which is what their result would be in a group of
one: the rank is 0, the world size 1, a reduction or broadcast leaves the tensor as it is, an
all-gather copies it. torch.distributed itself raises in that case; DeepSpeed scripts often
call these before or without a launcher.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..engine import Topology, gloo_on_loopback, lifecycle

ReduceOp = dist.ReduceOp
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default_pg_timeout


class _Done:
    """The handle an async_op collective returns when there was nothing to communicate."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Join the default process group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (what
    torchrun, the deepspeed launcher and our Ray workers set); a no-op if one exists already.

    A single process without those variables (and without rank/world_size) gets no group: the
    functions of this module then answer for a world of one. MPI discovery
    (auto_mpi_discovery) is not done here: launch with torchrun or set the variables.
    dist_init_required=False skips initialisation, as in DeepSpeed.
    """
    if is_initialized() or dist_init_required is False:
        return
    world = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
    # A launcher (torchrun, deepspeed) sets all of these, at any world size: DeepSpeed then
    # joins a process group even of one, and scripts call torch.distributed on it directly.
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if world <= 1 and init_method is None and not launched:
        return
    if (world > 1 and dist_backend is None and init_method is None and rank < 0
            and world_size < 0):
        Topology.from_environment(timeout_s=timeout.total_seconds())
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    gloo_on_loopback(os.environ.get("MASTER_ADDR", ""))
    kwargs: dict = {"timeout": timeout, "init_method": init_method}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, **kwargs)
    lifecycle.created_default_group()


def destroy_process_group(group: Any = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """LOCAL_RANK as the launcher set it (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if is_initialized() and group is not None \
        else group_rank


def get_backend(group: Any = None) -> Optional[str]:
    return dist.get_backend(group) if is_initialized() else None


def get_world_group() -> Any:
    return dist.group.WORLD if is_initialized() else None


def new_group(ranks: Optional[List[int]] = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs) if is_initialized() else None


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    if not is_initialized():
        tensor_list[0].copy_(tensor)
        return _Done() if async_op else None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _Done() if async_op else None
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _Done() if async_op else None
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                      async_op=async_op)


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    if not is_initialized():
        object_list[0] = obj
        return
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: List[Any], src: int = 0, group: Any = None) -> None:
    if is_initialized():
        dist.broadcast_object_list(object_list, src, group=group)
