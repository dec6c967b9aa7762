"""A PipelineModule of several stages under the engine: each rank trains its stage, data-parallel
with the other replicas of that stage, and torch.distributed.pipelining runs the micro-batches
through the stages (GPipe, 1F1B, or interleaved 1F1B when a rank holds several stages).

How a step goes: the schedule runs every micro-batch's forward and backward with the gradient
hooks disarmed, so gradients accumulate (in the stage's flat buffer at ZeRO 0/1, in .grad at
ZeRO 2); then the buckets are reduced once over the stage's replicas (reduce-scattered at ZeRO
2: the step's only gradient traffic), and the optimizer steps as after any accumulation window. The
gradient norm (clipping, the fp16 overflow check) sums over the stages too
(Topology.model_group). The loss is scaled by the loss scale inside the schedule's loss function
and its mean over micro-batches comes back unscaled.

A weight tied across stages (TiedLayerSpec) lives on each stage that uses it: its gradients
are summed over those stages before the data-parallel reduction, and only the first counts it
in the norm.

At ZeRO 3 the stage's parameters are gathered once before the schedule and released after
the reduction (Stage3Controller.held): the sharding saves the optimizer state and the master
weights between steps, and the schedule's micro-batches cost no gathers of their own.

"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn

from ...config import Config, ConfigError
from ..precision import autocast_region
from ..topology import Topology
from .module import PipelineModule, layout_of


def stage_topology(model: nn.Module, topology: Topology, config: Config) -> Topology:
    """The engine's data-parallel layout for `model`: its stage's replicas when it is split into
    stages, else `topology` as given."""
    layout = layout_of(model)
    if layout is None:
        return topology
    return dataclasses.replace(topology, rank=layout.dp_rank, world_size=layout.dp_size,
                               group=layout.dp_group if layout.dp_size > 1 else None,
                               model_group=layout.pp_group)


class _Stage(nn.Module):
    """The stage as the schedule calls it: under the engine's autocast, floating outputs in
    fp32 (what flows between stages and into the loss)."""

    def __init__(self, module: PipelineModule, device_type: str, dtype: torch.dtype, chunk: int = 0) -> None:
        super().__init__()
        self.inner, self.device_type, self.dtype, self.chunk = module, device_type, dtype, chunk

    def forward(self, *args: Any) -> Any:
        with autocast_region(self.device_type, self.dtype):
            out = self.inner(args[0] if len(args) == 1 else args, chunk=self.chunk)
        return out.float() if torch.is_tensor(out) and out.is_floating_point() else out


class PipeRunner:
    """The schedule of one engine's stage, built at the first train_batch."""

    def __init__(self, engine: Any) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        pc, gas = engine.config.pipeline, engine.gradient_accumulation_steps()
        if pc.micro_batches is not None and pc.micro_batches != gas:
            raise ConfigError(f"pipeline.micro_batches: {pc.micro_batches} differs from "
                              f"gradient_accumulation_steps {gas}; a step's micro-batches are its "
                              "accumulation steps: set one, or both equal")
        module: PipelineModule = engine.module
        layout = module.pipe_layout
        _check_schedule(pc.schedule, module.stages_per_rank, layout.num_stages, gas)
        self.engine, self.layout = engine, layout
        self.scale = 1.0
        device, total = engine.topology.device, layout.num_stages * module.stages_per_rank
        stages = [PipelineStage(_Stage(module, device.type, engine.compute_dtype, chunk=k), v, total,
                                device, group=layout.pp_group)
                  for k, v in enumerate(module.virtual_stages)]
        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}
        # The loss function scales as engine.backward does (loss scale / accumulation steps),
        # so the schedule must not divide the gradients again.
        self.schedule = kinds[pc.schedule](stages if len(stages) > 1 else stages[0], n_microbatches=gas,
                                           loss_fn=self._loss(module.loss_fn), scale_grads=False)

    def _loss(self, loss_fn: Optional[Callable]) -> Callable:
        def scaled(outputs: Any, labels: Any) -> torch.Tensor:
            loss = outputs if loss_fn is None else loss_fn(outputs, labels)
            return loss.float() * self.scale
        return scaled

    def step(self, micro: List[Any], train: bool = True) -> torch.Tensor:
        """Forward and backward (or, not `train`, forward only) of every micro-batch
        `(inputs, labels)`; this pipeline's loss of each micro-batch (on the last stage; zeros
        elsewhere)."""
        layout, engine = self.layout, self.engine
        gas = engine.gradient_accumulation_steps()
        self.scale = engine._scaler.loss_scale / gas if train else 1.0
        inputs = torch.cat([m[0] for m in micro]).to(engine.topology.device)
        labels = torch.cat([m[1] for m in micro]).to(engine.topology.device)
        losses: List[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if layout.last else {}
        run = self.schedule.step if train else self.schedule.eval
        if layout.first:
            run(inputs, **kwargs)
        else:
            run(**kwargs)
        if train:
            engine.module.reduce_tied_grads()
            engine.zero.norm_excluded = engine._norm_once | engine.module.duplicate_tied_params()
        if not layout.last:
            return torch.zeros(len(micro), device=engine.topology.device)
        return torch.stack([x.detach().float() for x in losses]) / self.scale

    def broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss (or losses) on every stage of this pipeline, as DeepSpeed
        returns it."""
        import torch.distributed as dist

        dist.broadcast(loss, group_src=self.layout.num_stages - 1, group=self.layout.pp_group)
        return loss


def _check_schedule(schedule: str, per_rank: int, num_stages: int, micro: int) -> None:
    """The schedule fits the stages this rank holds and the step's micro-batches."""
    if (schedule == "interleaved_1f1b") != (per_rank > 1):
        raise ConfigError(f"pipeline.schedule: {schedule!r} with the PipelineModule's "
                          f"stages_per_rank={per_rank}; interleaved_1f1b runs several stages per "
                          "rank, 1f1b and gpipe one: set pipeline.stages_per_rank and the schedule "
                          "together")
    rounds = max(1, micro // num_stages)
    if per_rank > 1 and micro % rounds:
        raise ConfigError(f"gradient_accumulation_steps: {micro} micro-batches do not split into "
                          f"rounds of the {num_stages} stages (interleaved_1f1b runs them "
                          f"{num_stages} at a time); use a multiple of {num_stages}, or fewer")
