"""Assembly steps of `initialize`: parameter groups, flat spaces, the torch optimizer.

Each function does one thing and returns plain objects, so the Engine's constructor reads as a
list of steps.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .zero import partial
from .zero.flat import FlatSpace
from .zero.offload import cpu_optimizer_kwargs
from .topology import Topology

ParamGroup = Tuple[List[nn.Parameter], Dict[str, Any]]  # parameters, per-group hyperparameters

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}


def param_groups(model: nn.Module, model_parameters: Optional[Iterable] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 renamed: Optional[Dict[int, nn.Parameter]] = None) -> List[ParamGroup]:
    """Trainable parameters split into optimizer groups, deduplicated (tied weights once).

    Source, first that is given: the client optimizer's groups, `model_parameters` (parameters
    or DeepSpeed/torch-style group dicts), else all of the model's trainable parameters.
    renamed: given when the model was split across processes before this (tensor parallelism,
    pipeline stages): the parameters the caller listed are replaced by their local shards, and
    those this rank no longer holds are left out.
    """
    if optimizer is not None:
        raw = [(list(g["params"]), {k: v for k, v in g.items() if k != "params"})
               for g in optimizer.param_groups]
    elif model_parameters is not None:
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            raw = [(list(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in items]
        else:
            raw = [(items, {})]
    else:
        raw = [(list(model.parameters()), {})]
    if renamed is not None:
        held = {id(p) for p in model.parameters()}
        raw = [([q for q in (renamed.get(id(p), p) for p in params) if id(q) in held], hyper)
               for params, hyper in raw]
    seen, groups = set(), []
    for params, hyper in raw:
        unique = [p for p in params if p.requires_grad and id(p) not in seen and not seen.add(id(p))]
        groups.append((unique, hyper))
    _check_covered(model, seen)
    return groups


def _check_covered(model: nn.Module, seen: set) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"model_parameters/optimizer: {len(missing)} trainable parameters are in no "
                         f"optimizer group (first: {missing[0]}); pass them or set requires_grad=False")


def build_spaces(groups: Sequence[ParamGroup], device: torch.device, bucket_numel: int,
                 num_shards: int, rank: int, offload_ratio: Optional[float] = None) -> List[FlatSpace]:
    """One FlatSpace per (group, storage dtype); parameters in reverse order (backward order).
    offload_ratio (optimizer offload): that share of each list goes into a space of its own
    whose masters live on the host (zero/partial.py); None: no offload."""
    spaces = []
    for gi, (params, _) in enumerate(groups):
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, ps in by_dtype.items():
            host, kept = partial.split(ps, offload_ratio) if offload_ratio is not None else ([], ps)
            for part, offloaded in ((host, True), (kept, False)):
                if part:
                    space = FlatSpace(list(reversed(part)), dtype, device, bucket_numel, num_shards, rank, gi)
                    space.offloaded = offloaded
                    spaces.append(space)
    return spaces


def broadcast_state(spaces: Sequence[FlatSpace], model: nn.Module, topo: Topology) -> None:
    """Start every rank from rank 0's weights and buffers (one collective per space), as DDP does.

    Buffers (BatchNorm statistics) are synchronised once here; afterwards each rank updates its
    own, as DDP does with broadcast_buffers=False.
    """
    if topo.world_size > 1:
        for s in spaces:
            if s.flat.numel():  # a space built from zero.Init shards took rank 0's values already
                dist.broadcast(s.flat, group_src=0, group=topo.group)
        for b in model.buffers():
            dist.broadcast(b, group_src=0, group=topo.group)


def build_optimizer(opt_type: str, params: Dict[str, Any], master_groups: List[List[nn.Parameter]],
                    hypers: Sequence[Dict[str, Any]], device: torch.device,
                    host_step: bool = False) -> torch.optim.Optimizer:
    """The config's optimizer over the fp32 masters, with the fastest implementation.

    Each master is one flat tensor, so even the foreach path is a handful of kernels; on CUDA
    the fused kernel does the whole update in one launch per dtype/device. A step on the CPU
    (offloaded, or a CPU engine) uses torch's fused CPU kernel where it has one, several times
    faster there than foreach (zero/offload.py).
    """
    cls = OPTIMIZERS[opt_type]
    kwargs = dict(params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    kwargs.update(cpu_optimizer_kwargs(cls) if host_step or device.type == "cpu" else _implementation(device))
    groups = [dict(hyper, params=ms) for ms, hyper in zip(master_groups, hypers) if ms]
    return cls(groups, **kwargs)


NO_EFFECT_KEYS = {  # accepted for DeepSpeed compatibility; what our design does instead
    "zero_optimization.allgather_bucket_size": "parameters are all-gathered per reduce bucket",
    "zero_optimization.contiguous_gradients": "gradients are always contiguous flat buffers",
    "zero_optimization.round_robin_gradients": "buckets are sharded evenly, no round robin needed",
    "zero_optimization.sub_group_size": "the optimizer steps one flat master per space",
    "wall_clock_breakdown": "use the benchmark or torch.profiler",
    "prescale_gradients": "the reducer divides before reducing whenever it reduces in 16 bits",
    "gradient_predivide_factor": "the same mean is reduced; the reducer picks where to divide",
    "zero_allow_untested_optimizer": "every torch optimizer is accepted with ZeRO",
    "zero_force_ds_cpu_optimizer": "an offloaded step uses torch's fused CPU optimizer",
    "bf16.immediate_grad_update": "gradients reach fp32 at the reduction (per micro-batch at ZeRO 2/3)",
    "dump_state": "use engine.memory_breakdown()",
    "zero_optimization.offload_optimizer.buffer_count": "masters live whole in host memory (nvme only)",
    "zero_optimization.offload_optimizer.fast_init": "host state is created in bulk already (nvme only)",
    "zero_optimization.mics_hierarchical_params_gather": "parameters are gathered in one flat all-gather",
    "zero_optimization.stage3_model_persistence_threshold": "stage3_param_persistence_threshold alone decides",
}


def no_effect_settings(flat_config: Dict[str, Any], defaults: Dict[str, Any]) -> List[str]:
    """Settings changed from their default that our engine accepts but has no use for."""
    return [f"{k}={flat_config[k]!r} ({why})" for k, why in NO_EFFECT_KEYS.items()
            if k in flat_config and flat_config[k] != defaults.get(k)]


def _implementation(device: torch.device) -> Dict[str, bool]:
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def rebind_client_optimizer(optimizer: torch.optim.Optimizer,
                            master_groups: List[List[nn.Parameter]]) -> torch.optim.Optimizer:
    """Point a client optimizer's groups at the fp32 masters, in place.

    In place, so that an LR scheduler the client built on this optimizer keeps working.
    """
    if len(optimizer.param_groups) != len(master_groups):
        raise ValueError("optimizer: param_groups changed while building the engine")
    for group, masters in zip(optimizer.param_groups, master_groups):
        group["params"] = list(masters)
    optimizer.state.clear()
    return optimizer
