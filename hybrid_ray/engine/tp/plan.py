"""A tensor-parallel plan: module-name patterns mapped to how each module is split across the
tensor-parallel ranks, turned into torch.distributed.tensor.parallel styles.

Values are "colwise" (a Linear's output features, an Embedding's columns), "colwise:N" (a
Linear whose output is N parts side by side, such as a fused q, k, v: each part split), "rowwise" (a
Linear's input features, an Embedding's rows: the vocabulary), "sequence" (a norm's weights
replicated, its activations split along the sequence) or any torch ParallelStyle, for the
cases the three words do not say (a head whose output must be whole, a fused projection).

With a "sequence" entry anywhere, the activations between the tensor-parallel regions are
sequence-split (Megatron's sequence parallelism): column-wise layers then gather the sequence
on the way in and row-wise layers reduce-scatter it on the way out. Without one they stay
whole on every rank (Megatron's original scheme).
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel)

from ...config import ConfigError
from .gather import cut

STYLE_NAMES = ("colwise", "rowwise", "sequence")


class FusedColwise(ColwiseParallel):
    """Column-wise for a Linear whose output is `chunks` equal parts side by side, as a fused
    q, k, v projection: every part is split across the ranks, so each rank holds its share of
    each (its heads' q, k and v) and its output is its `chunks` shares side by side."""

    def __init__(self, chunks: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.chunks = chunks

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % (self.chunks * size):
                raise ConfigError(f"tp_plan: {name}.{pname} has {param.shape[0]} output features: "
                                  f"{self.chunks} parts cannot each be split {size} ways")
            full = param.detach().clone()
            dist.broadcast(full, group_src=0, group=device_mesh.get_group())  # the first rank's values
            local = cut(full, 0, self.chunks, size, rank)
            # Declared Shard(0) of the whole weight: true of its shape, and the layout is never
            # redistributed (outputs go back to local tensors), only its gradient read locally.
            dt = DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False,
                                    shape=full.shape, stride=full.stride())
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


def _style(kind: Any, module: nn.Module, sequence: bool, key: str) -> ParallelStyle:
    if isinstance(kind, ParallelStyle):
        return kind
    between = Shard(1) if sequence else Replicate()
    if kind == "colwise":
        return ColwiseParallel(input_layouts=between)
    if isinstance(kind, str) and kind.startswith("colwise:") and kind[8:].isdigit() and int(kind[8:]) >= 1:
        if not isinstance(module, nn.Linear):
            raise ConfigError(f"tp_plan[{key!r}]: {kind!r} splits a Linear; got {type(module).__name__}")
        return FusedColwise(int(kind[8:]), input_layouts=between)
    if kind == "rowwise":
        if isinstance(module, nn.Embedding):  # token ids come in whole
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
        return RowwiseParallel(output_layouts=between)
    if kind == "sequence":
        return SequenceParallel()
    raise ConfigError(f"tp_plan[{key!r}]: unknown style; got {kind!r}; allowed: "
                      f"{', '.join(STYLE_NAMES)}, 'colwise:<parts>' or a torch ParallelStyle")


def resolve_plan(model: nn.Module, plan: Mapping[str, Any],
                 check: Optional[Callable[[set], set]] = None) -> Dict[str, ParallelStyle]:
    """Module name -> torch style, for every module a pattern matches (fnmatch; the first
    pattern that matches a module wins). A pattern that matches nothing is an error: a typo
    would otherwise leave a layer whole on every rank without a word. `check` narrows the
    patterns unmatched here to those unmatched everywhere (a pipeline's other stages)."""
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(f"tp_plan: expected a non-empty {{pattern: style}} mapping; got {plan!r}")
    sequence = any(v == "sequence" for v in plan.values())
    names = [(n, m) for n, m in model.named_modules() if n]
    out: Dict[str, ParallelStyle] = {}
    unmatched = set()
    for pattern, kind in plan.items():
        if not isinstance(pattern, str):
            raise ConfigError(f"tp_plan: patterns are module-name strings; got {pattern!r}")
        hits = [(n, m) for n, m in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            unmatched.add(pattern)
        for n, m in hits:
            if n not in out:
                out[n] = _style(kind, m, sequence, pattern)
    unmatched = check(unmatched) if check is not None else unmatched
    if unmatched:
        pattern = sorted(unmatched)[0]
        raise ConfigError(f"tp_plan[{pattern!r}]: matches no module of {type(model).__name__} "
                          f"(names such as {names[0][0] if names else '-'!r})")
    return out
