"""The (pp, dp, tp) layout of the world when a model replica spans several processes.

One DeviceMesh with the pipeline axis outermost and the tensor axis innermost (torchtitan's and
Megatron's order: a replica's tensor-parallel ranks are neighbours, so on a cluster they share a
node and its fast links): rank = (stage * dp + d) * tp + t. The data-parallel axis is what ZeRO
shards over; the ranks with the same d form one model replica (model_group), over which the
gradient norm is summed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError


@dataclass(frozen=True)
class ParallelMesh:
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    mesh: Any  # torch DeviceMesh over ("pp", "dp", "tp")
    model_group: Any  # the pp * tp ranks of this replica (None when that is this rank alone)

    @property
    def pp_group(self) -> Any:
        return self.mesh.get_group("pp")

    @property
    def dp_group(self) -> Any:
        return self.mesh.get_group("dp")

    @property
    def tp_group(self) -> Any:
        return self.mesh.get_group("tp")

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"]

    def replica_ranks(self, d: int) -> list:
        return replica_ranks(self.pp, self.dp, self.tp, d)


def replica_ranks(pp: int, dp: int, tp: int, d: int) -> list:
    """The global ranks of data-parallel replica d, pipeline-major."""
    return [(s * dp + d) * tp + t for s in range(pp) for t in range(tp)]


def build_mesh(pp: int, tp: int, device: Optional[torch.device] = None) -> ParallelMesh:
    """Collective: every rank of the world calls it with the same sizes."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}: "
                          "needs the process group first; launch with torchrun, the Ray layer, or "
                          "call hybrid_ray.init_distributed() before initialize")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (pp * tp):
        raise ConfigError(f"tensor_model_parallel_size * pipeline_model_parallel_size: {tp} * {pp} "
                          f"does not divide the world size {world}; the data-parallel size is "
                          "world / (tensor * pipeline)")
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // (pp * tp)
    device_type = (device or torch.device("cpu")).type
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    coords = (rank // (dp * tp), rank // tp % dp, rank % tp)
    model_group = None
    if pp * tp > 1:
        # new_group is collective over the whole world: every rank creates every replica's group
        # in the same order and keeps its own.
        for d in range(dp):
            group = dist.new_group(replica_ranks(pp, dp, tp, d))
            if d == coords[1]:
                model_group = group
    return ParallelMesh(pp, dp, tp, *coords, mesh, model_group)
