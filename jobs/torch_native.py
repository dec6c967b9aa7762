"""The torch-native baseline for tensor x pipeline x data parallelism, composed as torchtitan
composes them, from torch's public APIs only: DTensor tensor parallelism with sequence-parallel
norms and a loss computed on the vocabulary shards (loss_parallel), torch.distributed.pipelining
(one stage per rank, 1F1B or GPipe; with one stage, plain gradient accumulation instead, as
torchtitan runs it), and FSDP2 over the data-parallel ranks (bf16 parameters,
fp32 gradient reduction, no reshard after forward under a pipeline), fused AdamW, and the
gradient norm clipped over every stage.

The model is the project's GPT (hybrid_ray.models.GPT) with two changes a pipeline and a
fused-qkv tensor split need: the output head is its own weight (a copy of the token embedding
at the start; torchtitan's models do not tie either, and tied weights on two stages are the
engine's job, not torch's), and the fused qkv weight's rows are ordered per tensor-parallel rank
(q, k, v of rank 0's heads, then rank 1's, ...), so that a plain column split hands each rank
whole heads. `gpt_reference` gives the same model unsplit (one process) for tests.

`build(cfg, layout, ...)` returns a `NativeRun` whose `step(x, y)` trains one batch; see
jobs/bench_layouts.py for the measurement.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from hybrid_ray.models import GPT, GPTConfig


@dataclass(frozen=True)
class Layout:
    """tensor x pipeline x data-parallel sizes; their product is the world size."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def qkv_order(d_model: int, tp: int) -> torch.Tensor:
    """Row order of a fused qkv weight that a column split into tp parts hands whole heads:
    rank r's part is [q_r, k_r, v_r] (each d_model / tp rows)."""
    rows = torch.arange(3 * d_model).view(3, tp, d_model // tp)  # (q/k/v, rank, rows)
    return rows.transpose(0, 1).reshape(-1)


def gpt_reference(cfg: GPTConfig, seed: int, device: Optional[str] = None) -> GPT:
    """The baseline's model unsplit, as one process trains it: the GPT seeded with `seed`, its
    head untied (a copy of the embedding). On the meta device (device="meta") nothing is
    allocated: build() then initialises each rank's shards in place."""
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = GPT(cfg)
        model.head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


class Stage(nn.Module):
    """Blocks [first, last) of the GPT; the embeddings on the first stage, the final norm and
    the head on the last. Returns the logits on the last stage, else the hidden states."""

    def __init__(self, gpt: GPT, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.wte = gpt.wte if is_first else None
        self.wpe = gpt.wpe if is_first else None
        # a ModuleDict keeps the blocks' global indices in their names (as torchtitan does)
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(first, last)})
        self.ln_f = gpt.ln_f if is_last else None
        self.head = gpt.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def split_blocks(n_layer: int, pp: int) -> List[Tuple[int, int]]:
    """Blocks per stage as even as they go (earlier stages take the remainder: the last one
    also holds the head)."""
    base, extra = divmod(n_layer, pp)
    bounds, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _tensor_parallel(stage: Stage, mesh: DeviceMesh) -> None:
    """Megatron's split with sequence-parallel norms; the head's output stays split over the
    vocabulary for loss_parallel."""
    first = next(iter(stage.blocks))
    if stage.wte is not None:
        parallelize_module(stage, mesh, {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            f"blocks.{first}": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)})
    for block in stage.blocks.values():
        parallelize_module(block, mesh, {
            "ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "qkv": ColwiseParallel(input_layouts=Shard(1)), "fc": ColwiseParallel(input_layouts=Shard(1)),
            "proj": RowwiseParallel(output_layouts=Shard(1)), "out": RowwiseParallel(output_layouts=Shard(1))})
    if stage.head is not None:
        parallelize_module(stage, mesh, {
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})


def _reorder_qkv(gpt: GPT, tp: int) -> None:
    order = qkv_order(gpt.cfg.d_model, tp)
    with torch.no_grad():
        for block in gpt.blocks:
            block.qkv.weight.copy_(block.qkv.weight[order])
            if block.qkv.bias is not None:
                block.qkv.bias.copy_(block.qkv.bias[order])


def _init_in_place(stage: Stage) -> None:
    """GPT's initialisation of a stage made on the meta device, shard by shard (DTensor's
    random ops draw each shard's part of the whole tensor)."""
    with torch.no_grad():
        for m in stage.modules():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            else:
                GPT._init_weights(m)


@dataclass
class NativeRun:
    step: Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]
    stage: Stage
    mesh: DeviceMesh
    layout: Layout


def build(cfg: GPTConfig, layout: Layout, micro_batches: int, device: torch.device,
          dtype: torch.dtype = torch.bfloat16, seed: int = 0, schedule: str = "1f1b",
          exact: bool = True, lr: float = 3e-4, weight_decay: float = 0.1, eps: float = 1e-8,
          clip: float = 1.0) -> NativeRun:
    """This rank's stage, split and sharded, and its training step (`micro_batches` per step
    through the pipeline). exact: every rank builds the whole GPT from `seed`, so the weights
    equal gpt_reference's (small models); else the stage is made on the meta device and
    initialised shard by shard (a model that does not fit a rank whole)."""
    mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    gpt = gpt_reference(cfg, seed, None if exact else "meta")
    if exact and layout.tp > 1:
        _reorder_qkv(gpt, layout.tp)
    first, last = split_blocks(cfg.n_layer, layout.pp)[pp_rank]
    stage = Stage(gpt, first, last, pp_rank == 0, pp_rank == layout.pp - 1)
    del gpt
    stage = stage.to(device) if exact else stage
    if layout.tp > 1:
        _tensor_parallel(stage, mesh["tp"])
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = layout.pp == 1  # under a pipeline each micro-batch would gather the weights again
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(stage, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    if not exact:
        stage.to_empty(device=device)
        _init_in_place(stage)
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    if layout.pp > 1:
        forward_backward = _pipelined(stage, pp_rank, layout.pp, device, mesh, micro_batches, schedule)
    else:  # no pipeline: torchtitan runs the model itself, without a one-stage schedule
        forward_backward = _accumulating(stage, micro_batches)

    def step(x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        losses: List[torch.Tensor] = []
        with loss_parallel() if layout.tp > 1 else contextlib.nullcontext():  # backward inside too
            forward_backward(x, y, losses)
        _clip(params, clip, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # under loss_parallel each micro-batch's loss is a replicated DTensor: plain, for callers
        plain = [loss.full_tensor() if hasattr(loss, "full_tensor") else loss for loss in losses]
        return torch.stack([loss.detach() for loss in plain]).mean() if plain else None

    return NativeRun(step, stage, mesh, layout)


StepFn = Callable[[torch.Tensor, torch.Tensor, List[torch.Tensor]], None]


def _pipelined(stage: Stage, pp_rank: int, pp: int, device: torch.device, mesh: DeviceMesh,
               micro_batches: int, schedule: str) -> StepFn:
    """Forward and backward of one batch through the pipeline schedule (the last stage's
    per-micro-batch losses into `losses`)."""
    pipe = PipelineStage(stage, pp_rank, pp, device, group=mesh["pp"].get_group())
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = kind(pipe, n_microbatches=micro_batches, loss_fn=_loss)
    is_first, is_last = pp_rank == 0, pp_rank == pp - 1

    def run(x: torch.Tensor, y: torch.Tensor, losses: List[torch.Tensor]) -> None:
        sched.step(*((x,) if is_first else ()), **({"target": y, "losses": losses} if is_last else {}))
    return run


def _accumulating(stage: Stage, micro_batches: int) -> StepFn:
    """Forward and backward of one batch as `micro_batches` accumulated ones; FSDP2 reduces
    the gradients once, after the last (as the pipeline schedule scales them: by 1/n)."""
    def run(x: torch.Tensor, y: torch.Tensor, losses: List[torch.Tensor]) -> None:
        for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            stage.set_requires_gradient_sync(i == micro_batches - 1)
            loss = _loss(stage(xs), ys)
            (loss / micro_batches).backward()
            losses.append(loss.detach())
    return run


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT's loss in fp32; under loss_parallel() (the step's, with tensor parallelism) the same
    call computes it over the vocabulary shards of the head's output."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))


def _clip(params: List[nn.Parameter], max_norm: float, mesh: DeviceMesh) -> None:
    """Clip by the norm of every stage's gradients: per-mesh totals (DTensor reduces over the
    tensor and data shards), squared and summed over the pipeline ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(id(getattr(g, "device_mesh", None)), []).append(g)
    sq = torch.zeros((), device=grads[0].device if grads else "cpu", dtype=torch.float32)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        sq = sq + norm.float().to(sq.device) ** 2
    if mesh["pp"].size() > 1:
        dist.all_reduce(sq, group=mesh["pp"].get_group())
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt(), foreach=True)


def full_state(run: NativeRun) -> dict:
    """This stage's weights whole (DTensors gathered) in fp32 on the CPU, under GPT's names and
    with qkv rows in GPT's order; collective over the tensor and data ranks."""
    out = {}
    for name, p in run.stage.state_dict().items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().float().cpu()
    if run.layout.tp > 1:
        order = torch.argsort(qkv_order(run.stage.blocks[next(iter(run.stage.blocks))].qkv.in_features,
                                        run.layout.tp))
        for name in [n for n in out if n.endswith(("qkv.weight", "qkv.bias"))]:
            out[name] = out[name][order]
    return out
