"""How the engine lays one model replica over several processes: tensor parallelism
(tensor_model_parallel_size, a tp_plan), pipeline stages (a PipelineModule, cut by its
num_stages or by pipeline_model_parallel_size), and ZeRO on the data-parallel axis that is left.

The engine keeps one Topology: its rank, world_size and group are the data-parallel axis (what
ZeRO shards and reduces over, what the batch arithmetic divides by); `model_group` is the rest
of this replica, over which the gradient norm sums; `mesh` is the whole (pp, dp, tp) layout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import Config, ConfigError
from .mesh import ParallelMesh, build_mesh
from .pipe.layout import layout_on_mesh
from .pipe.module import PipelineModule, layout_of
from .pipe.stages import stage_topology
from .topology import Topology
from .checkpoint.split import SplitLayout
from .tp import TensorParallelModel, apply_plan
from .tp.gather import unshard


def parallel_topology(model: nn.Module, topology: Topology, config: Config,
                      tp_plan: Optional[Mapping[str, Any]] = None
                      ) -> Tuple[Topology, Optional[TensorParallelModel]]:
    """Place `model` on the world and return the engine's (data-parallel) topology and, when
    the model was placed here (tensor parallelism, stages cut by the config), what that did.
    Collective when anything is split."""
    config.data_parallel_size(topology.world_size)  # the config's sizes fit the world, or a ConfigError
    tp, pp = config.tensor_model_parallel_size, _stages(model, config)
    own = layout_of(model)
    if tp == 1 and (own is not None or pp == 1):  # one process per replica, or stages as built
        return stage_topology(model, topology, config), None
    model.to(topology.device)
    pm = build_mesh(pp, tp, topology.device)
    if pp > 1:
        lay = layout_on_mesh(pm)
        if own is None:
            model.place(lay, config.pipeline.stages_per_rank, config.pipeline.partition_method)
        else:
            model.pipe_layout = lay  # the same stages and pipelines; the replicas now span tp too
    tpm = TensorParallelModel()  # nothing split within a stage, but the stage is a part now
    if tp > 1:
        plan = _plan_of(model, tp_plan, tp)
        tpm = apply_plan(model, plan, pm.tp_mesh, check=_unmatched_everywhere(pm) if pp > 1 else None)
    topo = dataclasses.replace(topology, rank=pm.dp_rank, world_size=pm.dp,
                               group=pm.dp_group if pm.dp > 1 else None,
                               model_group=pm.model_group, mesh=pm)
    return topo, tpm


def _stages(model: nn.Module, config: Config) -> int:
    """The pipeline's stage count: the module's num_stages or the config's, which must agree."""
    want = config.pipeline_model_parallel_size
    if not isinstance(model, PipelineModule):
        if want > 1:
            raise ConfigError(f"pipeline_model_parallel_size: {want} needs the model as a "
                              "hybrid_ray.pipe.PipelineModule (a list of layers to cut into stages); "
                              f"got {type(model).__name__}")
        return 1
    if model.stages_given:
        if want > 1 and want != model.num_stages:
            raise ConfigError(f"pipeline_model_parallel_size: {want} differs from the "
                              f"PipelineModule's num_stages={model.num_stages}; set one, or both equal")
        if model.num_stages > 1:  # one stage runs as a plain sequential model, however cut
            _check_cut(model, config)
        return model.num_stages
    return want


def _check_cut(model: PipelineModule, config: Config) -> None:
    """A module cut at construction (num_stages given) was cut its own way: the config's
    pipeline section may only repeat it."""
    pc = config.pipeline
    if pc.stages_per_rank > 1 and pc.stages_per_rank != model.stages_per_rank:
        raise ConfigError(f"pipeline.stages_per_rank: {pc.stages_per_rank} differs from the "
                          f"PipelineModule's stages_per_rank={model.stages_per_rank} (it was cut "
                          "when built, num_stages given); set one, or both equal")
    method = pc.partition_method
    if method is not None and method.lower() != model.partition_method.lower():
        raise ConfigError(f"pipeline.partition_method: {method!r} differs from the PipelineModule's "
                          f"partition_method={model.partition_method!r} (it was cut when built, "
                          "num_stages given); set one, or both equal")


def _plan_of(model: nn.Module, tp_plan: Optional[Mapping[str, Any]], tp: int) -> Mapping[str, Any]:
    if tp_plan is not None:
        return tp_plan
    own: Optional[Callable] = getattr(model, "tp_plan", None)
    if callable(own):
        return own()
    raise ConfigError(f"tensor_model_parallel_size: {tp} needs a tensor-parallel plan: pass "
                      "initialize(..., tp_plan={pattern: 'colwise' | 'rowwise' | 'sequence'}) or give "
                      f"{type(model).__name__} a tp_plan() method")


def _unmatched_everywhere(pm: ParallelMesh) -> Callable[[set], set]:
    """With stages a pattern may match modules of some stages only: it is an error only when it
    matches none of the pipeline's."""
    def check(unmatched: set) -> set:
        gathered = [None] * pm.pp
        dist.all_gather_object(gathered, sorted(unmatched), group=pm.pp_group)
        return set.intersection(*(set(g) for g in gathered))
    return check


def whole_state(state: Dict[str, torch.Tensor], placed: Optional[TensorParallelModel],
                pm: Optional[ParallelMesh], layout: Any, device: torch.device,
                rank0_only: bool) -> Dict[str, torch.Tensor]:
    """The whole model's state from every rank's part (`state`: this rank's, whole over the
    data-parallel axis), under the names of the unsplit model: the tensor-parallel shards
    joined, the stages (`layout`, a PipeLayout) merged. Collective over the model's ranks."""
    if pm is not None and pm.tp > 1:
        state = unshard(state, placed, pm.tp_group, pm.tp, device)
    if layout is not None:
        stages: List[Any] = [None] * layout.num_stages
        dist.all_gather_object(stages, state, group=layout.pp_group)
        state = {k: v for part in stages for k, v in part.items()}
    return state if not rank0_only or dist.get_rank() == 0 else {}


def checkpoint_topology(topology: Topology, model: nn.Module) -> Topology:
    """The ranks that take part in a checkpoint: the engine's data-parallel ranks, or with the
    model split over processes, the whole world (every rank writes its part and its marker)."""
    if topology.mesh is None and layout_of(model) is None:
        return topology
    return dataclasses.replace(topology, rank=dist.get_rank(), world_size=dist.get_world_size(),
                               group=dist.group.WORLD, model_group=None)


def checkpoint_split(topology: Topology, model: nn.Module,
                     placed: Optional[TensorParallelModel]) -> Optional[SplitLayout]:
    """How a checkpoint joins this rank's part with the others' (None: nothing is split)."""
    pm, lay = topology.mesh, layout_of(model)
    if pm is None and lay is None:
        return None
    tp, tp_rank = (pm.tp, pm.tp_rank) if pm is not None else (1, 0)
    stages = lay.num_stages if lay is not None else 1
    size = dist.get_world_size() // stages
    rank = dist.get_rank()
    return SplitLayout(rank=rank, world=dist.get_world_size(), stage_first=rank // size * size,
                       stage_size=size, tp=tp, tp_rank=tp_rank,
                       tp_group=pm.tp_group if pm is not None else None, pp=stages,
                       pp_group=lay.pp_group if lay is not None else None,
                       placements=placed.placements if placed else {},
                       parts=placed.parts if placed else {}, device=topology.device,
                       layout={"tp": tp, "pp": stages, "dp": topology.world_size})
