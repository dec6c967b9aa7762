"""Precision per module: which dtype each module stores its parameters in and computes in.

How it works: the engine runs the whole forward under `torch.autocast(base dtype)` with the
parameters already stored in that dtype, so matmuls run in fp16/bf16 without casting weights
every step, and autocast keeps its fp32 ops (softmax, cross-entropy, ...) in fp32. Modules that
need another precision (normalisation layers, an `FP16Layer`, a `precision.modules` pattern) get
their forward wrapped in a different autocast region that casts floating inputs to fp32 where
that region is fp32. Wrappers are only placed where the precision changes, so a uniform bf16
model pays for none.
"""
from __future__ import annotations

import copy
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.hardware import native_bf16
from .forward_chain import unwrap_forward

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HALF = (torch.float16, torch.bfloat16)

# Normalisation layers stay fp32 under fp16/bf16: their statistics lose too much
# precision in half, and their parameters are tiny.
NORM_TYPES: Tuple[type, ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
                                nn.LocalResponseNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

# Norms that CUDA autocast already computes in fp32 (they are on its fp32 op list): when their
# parameters are fp32 they need no hook there. CPU autocast runs them in half, so CPU hooks them.
_AUTOCAST_FP32_NORMS = {"cuda": (nn.LayerNorm, nn.GroupNorm)}

# Norms that `precision.norm_activations: half` feeds half activations without casts: torch's
# LayerNorm kernel accumulates statistics in fp32 for half inputs. RMSNorm is not one: given
# mixed dtypes, torch falls back from its fused kernel to a slower composite.
MIXED_DTYPE_NORMS: Tuple[type, ...] = (nn.LayerNorm,)
# Devices whose LayerNorm kernel reads fp32 weight and bias with a half input. Elsewhere (CUDA:
# "expected scalar type BFloat16 but found Float") the fp32 parameters are cast to the input's
# dtype for the kernel, as autocast does for every matmul weight; they stay fp32 masters.
_MIXED_LAYER_NORM_DEVICES = ("cpu",)


def dtype_of(name: str) -> torch.dtype:
    """'fp32' | 'fp16' | 'bf16' -> torch dtype."""
    return DTYPES[name]


def is_norm(module: nn.Module) -> bool:
    """Known norm classes, and user classes named like one (LlamaRMSNorm, T5LayerNorm, ...)."""
    return isinstance(module, NORM_TYPES) or type(module).__name__.lower().endswith("norm")


def _floating_to(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor inside (nested tuples/lists/dicts) to dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        cast = [_floating_to(o, dtype) for o in obj]
        return type(obj)(*cast) if hasattr(obj, "_fields") else type(obj)(cast)
    if isinstance(obj, dict):
        cast = {k: _floating_to(v, dtype) for k, v in obj.items()}
        if type(obj) is dict:
            return cast
        # a dict subclass keeps its type: transformers' ModelOutput is read as `outputs.loss`
        out = copy.copy(obj)
        for k, v in cast.items():
            out[k] = v
        return out
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Public alias used by the engine to cast forward outputs to fp32."""
    return _floating_to(obj, dtype)


def _device_type(module: nn.Module, args: tuple) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


def autocast_region(device_type: str, dtype: torch.dtype) -> torch.autocast:
    """An autocast context computing in dtype; fp32 means autocast off."""
    if dtype in HALF:
        return torch.autocast(device_type, dtype=dtype)
    return torch.autocast(device_type, enabled=False)


class PrecisionRegion:
    """Runs one module's forward in its own precision: an autocast region around it, floating
    inputs cast to fp32 where that region is fp32.

    The module's `forward` is replaced by a `RegionForward` (an instance attribute) that opens
    the region with a `with` block, rather than a pre/post hook pair that enters and leaves the
    autocast context in two calls: torch.compile traces a `with torch.autocast` inside the
    forward, and cannot trace a context entered in one hook and left in another.
    restore_output: cast floating outputs back to fp32 when the caller is not under autocast
    (an fp16 layer inside an fp32 model must hand fp32 to the next fp32 layer, or the next
    matmul fails on mixed dtypes).
    """

    cast_inputs = True

    def __init__(self, module: nn.Module, dtype: torch.dtype, restore_output: bool = True):
        self.module = module
        self.dtype = dtype
        self.restore_output = restore_output
        self._forward = RegionForward(self, module.forward)
        module.forward = self._forward  # type: ignore[method-assign]

    def run(self, inner: Any, args: tuple, kwargs: dict) -> Any:
        device_type = _device_type(self.module, args)
        outer_autocast = torch.is_autocast_enabled(device_type)
        with autocast_region(device_type, self.dtype):
            if self.cast_inputs and self.dtype not in HALF:  # autocast is off inside: fp32 inputs
                args, kwargs = _floating_to(args, self.dtype), _floating_to(kwargs, self.dtype)
            output = inner(*args, **kwargs)
        if self.restore_output and not outer_autocast and self.dtype in HALF:
            return _floating_to(output, torch.float32)
        return output

    def remove(self) -> None:
        """Unwrap: wherever the RegionForward sits in the chain of instance-level forwards
        (activation checkpointing may have wrapped it since), the forward it wrapped takes its place."""
        unwrap_forward(self.module, self._forward)


class RegionForward:
    """Stands in for a module's `forward`: the original, inside its precision region.

    A callable object rather than a closure, so `copy.deepcopy(model)` rebinds the original
    forward and the region to the copy."""

    def __init__(self, region: PrecisionRegion, original: Any):
        self.region = region
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.region.run(self.original, args, kwargs)


class HalfActivationNorm(PrecisionRegion):
    """An fp32 LayerNorm fed half activations as they are: autocast off, no casts in or out.

    The kernel computes mean and variance in fp32 whatever its input dtype, so only the storage
    of the activations differs from the fp32 region, and that storage is half on both sides
    anyway (the residual stream before, the next matmul's input after). Saves four casts of a
    full activation per norm per step (about 5% of a 1.3B GPT step on an H200)."""

    cast_inputs = False

    def __init__(self, module: nn.LayerNorm):
        super().__init__(module, torch.float32, restore_output=False)
        self._plain = self._forward.original
        self._forward.original = functools.partial(_half_layer_norm, module)

    def remove(self) -> None:
        self._forward.original = self._plain  # unwrapping restores the module's own forward
        super().remove()


def _half_layer_norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if x.dtype in HALF and x.device.type not in _MIXED_LAYER_NORM_DEVICES:
        weight = weight.to(x.dtype) if weight is not None else None
        bias = bias.to(x.dtype) if bias is not None else None
    return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)


class FP16Module(nn.Module):
    """Base class for a module that computes in half precision inside a model (`FP16_Module` in
    DeepSpeed-style code).

    Subclasses override `forward` and use `self.module`; the forward runs under fp16 autocast
    (or `dtype`), and the engine stores the wrapped parameters in that dtype with fp32 masters.
    Outputs are returned as the subclass produces them (the seed's example returns `x.half()`).
    """

    def __init__(self, module: Optional[nn.Module] = None, dtype: torch.dtype = torch.float16,
                 restore_output: bool = False):
        super().__init__()
        if module is not None:
            self.module = module
        self.precision_dtype = dtype
        self._region = PrecisionRegion(self, dtype, restore_output=restore_output)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class FP16Layer(FP16Module):
    """Wrap one layer to compute in fp16 while the rest of the model stays fp32 (`FP16_Layer` in
    DeepSpeed-style code).

    `FP16Layer(nn.Linear(768, 3072))` stores and computes the layer in half precision; its
    floating outputs come back as fp32 when the caller computes in fp32.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.float16):
        super().__init__(module, dtype=dtype, restore_output=True)


@dataclass
class PrecisionPlan:
    """Per-module compute dtypes chosen by a policy, and the hooks that enforce them."""

    base: torch.dtype
    module_dtype: Dict[nn.Module, torch.dtype] = field(default_factory=dict)
    regions: list = field(default_factory=list)

    def param_dtypes(self, model: nn.Module) -> Iterator[Tuple[nn.Parameter, torch.dtype]]:
        """Each parameter once, with the dtype it is stored in: its module's compute dtype, or
        fp32 where modules of different dtypes share it (GPT's embedding tied to an fp32 head).

        Autocast casts an fp32 weight down for a half module, but a half weight cannot serve an
        fp32 module (its matmul sees mixed dtypes), and storing it in half first would round
        away the initial weights' precision.
        """
        chosen: Dict[int, Tuple[nn.Parameter, torch.dtype]] = {}
        for module in model.modules():
            dtype = self.module_dtype.get(module, self.base)
            for p in module.parameters(recurse=False):
                prev = chosen.get(id(p))
                chosen[id(p)] = (p, dtype if prev is None or prev[1] == dtype else torch.float32)
        return iter(chosen.values())

    def remove(self) -> None:
        for r in self.regions:
            r.remove()
        self.regions.clear()


class PrecisionPolicy:
    """Decides each module's dtype: FP16Module marker > name pattern > norm rule > parent's."""

    def __init__(self, base: torch.dtype, modules: Optional[Mapping[str, str]] = None,
                 norms_fp32: bool = True, norm_activations: str = "fp32"):
        self.base = base
        self.patterns = [(re.compile(p), DTYPES[d]) for p, d in (modules or {}).items()]
        self.norms_fp32 = norms_fp32
        self.half_norm_io = norm_activations == "half" and base in HALF

    def _own_dtype(self, name: str, module: nn.Module) -> Optional[torch.dtype]:
        if isinstance(module, FP16Module):
            return module.precision_dtype
        for pattern, dtype in self.patterns:
            if pattern.fullmatch(name):
                return dtype
        if self.norms_fp32 and is_norm(module):
            return torch.float32
        return None

    def plan(self, model: nn.Module) -> Dict[nn.Module, Tuple[torch.dtype, bool]]:
        """module -> (dtype, whether its dtype differs from its parent's)."""
        out: Dict[nn.Module, Tuple[torch.dtype, bool]] = {}

        def visit(name: str, module: nn.Module, parent_dtype: torch.dtype) -> None:
            own = self._own_dtype(name, module)
            dtype = own if own is not None else parent_dtype
            out.setdefault(module, (dtype, dtype != parent_dtype))
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child, dtype)

        visit("", model, self.base)
        return out

    def apply(self, model: nn.Module, device_type: str) -> PrecisionPlan:
        """Store each module's parameters in its dtype and hook where the dtype changes."""
        result = PrecisionPlan(self.base)
        skip_norms = _AUTOCAST_FP32_NORMS.get(device_type, ()) if self.base in HALF else ()
        for module, (dtype, changes) in self.plan(model).items():
            result.module_dtype[module] = dtype
            if not changes or isinstance(module, FP16Module):
                continue  # same as the parent, or it carries its own region
            if dtype == torch.float32 and self.half_norm_io and isinstance(module, MIXED_DTYPE_NORMS):
                result.regions.append(HalfActivationNorm(module))
                continue
            if dtype == torch.float32 and isinstance(module, skip_norms):
                continue  # autocast on this device already runs it in fp32
            result.regions.append(PrecisionRegion(module, dtype, restore_output=True))
        for p, dtype in result.param_dtypes(model):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for module in result.module_dtype:
            _buffers_follow_params(module)
        if device_type == "cpu" and torch.bfloat16 in result.module_dtype.values():
            _say_if_bf16_is_emulated()
        return result


@functools.lru_cache(maxsize=None)  # once per process
def _say_if_bf16_is_emulated() -> None:
    if not native_bf16("cpu"):
        logging.getLogger("hybrid_ray").warning(
            "bf16 on this CPU is emulated (no AVX512-BF16 or AMX): its matmuls run several times "
            "slower than in fp32; bf16.enabled: \"auto\" trains in fp32 on such a CPU")


def _buffers_follow_params(module: nn.Module) -> None:
    """Cast a module's floating buffers to its parameters' dtype.

    Kernels that take both (batch_norm's running statistics) require one dtype, so a BatchNorm
    kept in bf16 (`norms_fp32: false`) needs bf16 statistics, and one kept in fp32 inside a model
    the user cast to half needs fp32 ones. Buffers of modules without parameters (rotary caches,
    masks) are left as the model made them.
    """
    dtype = next((p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()), None)
    if dtype is None:
        return
    for b in module.buffers(recurse=False):
        if b.is_floating_point() and b.dtype != dtype:
            b.data = b.data.to(dtype)
