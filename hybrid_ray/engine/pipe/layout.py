"""Where a process sits when the world is split into pipeline stages: a (pp, dp) DeviceMesh,
the pipeline axis outermost as in DeepSpeed's PipeDataParallelTopology (rank = stage * dp + d).
Every rank of a stage is a data-parallel replica of that stage; ranks with the same d form one
pipeline. With tensor parallelism too the engine re-places the stages on its (pp, dp, tp) mesh
(engine/mesh.py): a stage then has dp * tp ranks, each the head of its own pipeline
(`pipes` of them, rank = stage * pipes + pipe_index either way)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ...config import ConfigError


@dataclass(frozen=True)
class PipeLayout:
    num_stages: int
    stage: int
    dp_rank: int
    dp_size: int
    pp_group: Any  # this rank's pipeline: the stages with the same data-parallel index
    dp_group: Any  # this stage's data-parallel replicas
    mesh: Any = None
    pipes: int = 0  # ranks per stage (dp, or dp * tp); 0: dp_size
    pipe_index: int = -1  # which of them this rank is; -1: dp_rank

    def __post_init__(self) -> None:
        if self.pipes == 0:
            object.__setattr__(self, "pipes", self.dp_size)
        if self.pipe_index < 0:
            object.__setattr__(self, "pipe_index", self.dp_rank)

    def pipeline_ranks(self, stages: List[int], pipe: int) -> List[int]:
        """The global ranks of pipeline `pipe` at `stages`."""
        return [s * self.pipes + pipe for s in stages]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def build_layout(num_stages: int, device: Optional[torch.device] = None) -> PipeLayout:
    """Collective: every rank of the world calls it (it creates the mesh's process groups)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"PipelineModule num_stages={num_stages}: needs the process group first; "
                          "call hybrid_ray.init_distributed() (or launch with torchrun) before "
                          "building the PipelineModule")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % num_stages:
        raise ConfigError(f"PipelineModule num_stages: {num_stages} does not divide the world size "
                          f"{world}; the data-parallel size is world / num_stages")
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // num_stages
    device_type = (device or torch.device("cpu")).type
    mesh = init_device_mesh(device_type, (num_stages, dp), mesh_dim_names=("pp", "dp"))
    return PipeLayout(num_stages, rank // dp, rank % dp, dp, mesh.get_group("pp"),
                      mesh.get_group("dp"), mesh)


def layout_on_mesh(pm: Any) -> PipeLayout:
    """The stage placement on the engine's (pp, dp, tp) mesh (a ParallelMesh)."""
    return PipeLayout(pm.pp, pm.pp_rank, pm.dp_rank, pm.dp, pm.pp_group, pm.dp_group, pm.mesh,
                      pipes=pm.dp * pm.tp, pipe_index=pm.dp_rank * pm.tp + pm.tp_rank)


def partition(weights: List[float], parts: int) -> List[int]:
    """Boundaries [0, b1, ..., len] cutting `weights` into `parts` contiguous, non-empty pieces
    whose heaviest piece is as light as it can be (bisection on that weight, greedy fill)."""
    n = len(weights)
    if n < parts:
        raise ConfigError(f"PipelineModule: {n} layers cannot fill {parts} stages")

    def greedy(limit: float) -> List[int]:
        bounds, total = [0], 0.0
        for i, w in enumerate(weights):
            if total + w > limit and i > bounds[-1]:
                bounds.append(i)
                total = 0.0
            total += w
        return bounds + [n]

    lo, hi = max(weights), float(sum(weights))
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(greedy(mid)) - 1 <= parts else (mid, hi)
    bounds = greedy(hi)
    while len(bounds) - 1 < parts:  # fewer pieces than stages: split one, never raising the max
        k = max((k for k in range(len(bounds) - 1) if bounds[k + 1] - bounds[k] > 1),
                key=lambda k: sum(weights[bounds[k]:bounds[k + 1]]))
        a, b = bounds[k], bounds[k + 1]
        cut = min(range(a + 1, b), key=lambda j: max(sum(weights[a:j]), sum(weights[j:b])))
        bounds.insert(k + 1, cut)
    return bounds
