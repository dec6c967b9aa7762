"""Flops, parameters and forward latency per module, measured with torch's own flop counter.

torch.utils.flop_counter.FlopCounterMode counts matmul, convolution and attention flops and
attributes them to modules, backward included (its ModuleTracker follows autograd). What we add:
- formulas for the CPU flash-attention kernels, which torch's registry lacks (the CUDA ones are
  there), so attention is counted on every device;
- parameter counts read while each module runs: ZeRO-3 parameters are empty tensors between uses;
- forward latency per module, measured in a pass of its own: under the counting mode every op
  goes through Python dispatch, and times taken there would mostly measure that.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.flop_counter import (FlopCounterMode, sdpa_backward_flop_count,
                                      sdpa_flop_count)

GLOBAL = "Global"  # FlopCounterMode's key for everything counted, inside a module or not


def _cpu_sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,
                       out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _extra_formulas() -> Dict[object, Callable]:
    aten = torch.ops.aten
    out: Dict[object, Callable] = {}
    # Like torch's own sdpa formulas these count the full score matrix, causal or not.
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_forward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward
    return out


def flop_counter() -> FlopCounterMode:
    """A silent FlopCounterMode that also counts the CPU attention kernels."""
    return FlopCounterMode(display=False, depth=None, custom_mapping=_extra_formulas())


@dataclass
class ModuleStats:
    """One module's share of a profiled pass; flops and latency include its children."""

    name: str
    """Qualified name as in `named_modules()`; '' is the root."""
    depth: int
    """0 for the root, 1 for its children, ..."""
    params: int = 0
    """Parameters of the module and its children (counted while they ran)."""
    flops: int = 0
    """Flops counted in the pass (forward, plus backward when the pass had one)."""
    forward_flops: int = 0
    """Flops of the forward alone."""
    latency_s: float = 0.0
    """Forward time summed over the module's calls in the timed pass (0 when untimed)."""
    calls: int = 0
    """Forward calls in the timed pass."""


@dataclass
class Profile:
    """The result of one profiled pass: totals and per-module statistics."""

    modules: Dict[str, ModuleStats]
    """By qualified name, in `named_modules()` order."""
    flops: int
    """All flops counted, including ops outside the model (a loss computed by the caller)."""
    forward_flops: int
    params: int
    forward_s: Optional[float] = None
    """Wall time of the timed forward (device-synchronised)."""
    backward_s: Optional[float] = None
    samples: Optional[int] = None
    """Leading dimension of the first tensor input: the micro-batch size, where there is one."""
    tokens_per_sample: Optional[int] = None
    """Second dimension of an integer (token id) input of two or more dims, else None."""
    title: str = "forward"
    model: str = ""
    """The root module's class name."""
    notes: List[str] = field(default_factory=list)

    @property
    def macs(self) -> int:
        """Multiply-accumulates: every op torch counts (matmul, conv, attention) is 2 flops per MAC."""
        return self.flops // 2

    @property
    def backward_flops(self) -> int:
        return self.flops - self.forward_flops


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def clock(device_type: str) -> float:
    """perf_counter after the device's queued work is done."""
    sync(device_type)
    return time.perf_counter()


def batch_shape(args: tuple, kwargs: dict) -> Tuple[Optional[int], Optional[int]]:
    """(samples, tokens per sample) read from the first tensor input, when it tells."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            integer = not (value.is_floating_point() or value.is_complex())
            tokens = int(value.shape[1]) if integer and value.dim() >= 2 else None
            return int(value.shape[0]), tokens
    return None, None


class FlopsCapture:
    """Counts flops per module and reads parameter counts while active (start ... stop)."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.names = {m: n for n, m in root.named_modules()}
        self.mode = flop_counter()
        # Per module, its own parameters' sizes by id: a tied weight (embedding and head) is
        # one parameter and counts once in any module holding both.
        self.own_params: Dict[str, Dict[int, int]] = {}
        self.forward_counts: Dict[str, int] = {}
        self._handles: list = []
        self.active = False

    def start(self) -> None:
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(self._read_params))
            self._handles.append(module.register_forward_hook(self._read_params_after))
        self.mode.__enter__()
        self.active = True

    def _read_params(self, module: nn.Module, args: tuple) -> None:
        seen = self.own_params.setdefault(self.names[module], {})
        for p in module.parameters(recurse=False):
            seen[id(p)] = max(p.numel(), seen.get(id(p), 0))

    def _read_params_after(self, module: nn.Module, args: tuple, out: object) -> None:
        self._read_params(module, args)

    def mark_forward_done(self) -> None:
        """Snapshot the counts so far: what follows is backward."""
        self.forward_counts = _totals(self.mode)

    def stop(self) -> Dict[str, int]:
        """Leave the counting mode; flops per FlopCounterMode module name (and GLOBAL)."""
        if self.active:
            self.active = False
            self.mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return _totals(self.mode)

    def build(self, totals: Dict[str, int], forward: Optional[Dict[str, int]] = None) -> Profile:
        """Per-module statistics from the counter's totals (forward: the snapshot, or totals)."""
        forward = totals if forward is None else forward
        prefix = type(self.root).__name__  # ModuleTracker names the root by its class
        modules: Dict[str, ModuleStats] = {}
        for name in self.names.values():
            key = prefix if name == "" else f"{prefix}.{name}"
            modules[name] = ModuleStats(name, 0 if name == "" else name.count(".") + 1,
                                        flops=totals.get(key, 0), forward_flops=forward.get(key, 0))
        _sum_containers(modules, set(totals), prefix)
        own = self._own_sizes()
        for name, stats in modules.items():
            sizes: Dict[int, int] = {}
            for child, child_sizes in own.items():
                if _within(child, name):
                    sizes.update(child_sizes)
            stats.params = sum(sizes.values())
        return Profile(modules, totals.get(GLOBAL, 0), forward.get(GLOBAL, 0),
                       modules[""].params, model=prefix)

    def _own_sizes(self) -> Dict[str, Dict[int, int]]:
        """Each module's own parameter sizes: as they are now, or as read while it ran if
        larger (ZeRO-3 empties them between uses); modules that did not run count too."""
        out: Dict[str, Dict[int, int]] = {}
        for module, name in self.names.items():
            seen = self.own_params.get(name, {})
            out[name] = {id(p): max(p.numel(), seen.get(id(p), 0))
                         for p in module.parameters(recurse=False)}
        return out


def _sum_containers(modules: Dict[str, ModuleStats], ran: set, prefix: str) -> None:
    """A container that is never called (an nn.ModuleList) gets the sum of its children."""
    for stats in sorted(modules.values(), key=lambda m: -m.depth):
        key = prefix if stats.name == "" else f"{prefix}.{stats.name}"
        if key in ran or stats.depth == 0:
            continue
        children = [m for m in modules.values() if m.depth == stats.depth + 1
                    and m.name.startswith(stats.name + ".")]
        stats.flops = sum(c.flops for c in children)
        stats.forward_flops = sum(c.forward_flops for c in children)


def _totals(mode: FlopCounterMode) -> Dict[str, int]:
    return {name: sum(ops.values()) for name, ops in mode.get_flop_counts().items()}


def _within(child: str, parent: str) -> bool:
    return parent == "" or child == parent or child.startswith(parent + ".")


class LatencyTimer:
    """Forward time per module, inclusive of children: CUDA events on a GPU (no sync per
    module, so no bubbles are added), perf_counter on a CPU."""

    def __init__(self, root: nn.Module, device_type: str):
        self.names = {m: n for n, m in root.named_modules()}
        self.cuda = device_type == "cuda"
        self._open: Dict[nn.Module, list] = {}
        self._spans: List[Tuple[str, object, object]] = []
        self._handles: list = []

    def start(self) -> None:
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._open.setdefault(module, []).append(self._mark())

    def _leave(self, module: nn.Module, args: tuple, out: object) -> None:
        starts = self._open.get(module)
        if starts:  # a hook added mid-forward sees a leave without its enter
            self._spans.append((self.names[module], starts.pop(), self._mark()))

    def stop(self) -> Dict[str, Tuple[float, int]]:
        """Remove the hooks; {name: (seconds, calls)}."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.cuda:
            torch.cuda.synchronize()
        out: Dict[str, Tuple[float, int]] = {}
        for name, start, end in self._spans:
            dt = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            seconds, calls = out.get(name, (0.0, 0))
            out[name] = (seconds + dt, calls + 1)
        self._spans.clear()
        self._open.clear()
        return out


def add_latency(profile: Profile, latency: Dict[str, Tuple[float, int]]) -> None:
    for name, (seconds, calls) in latency.items():
        if name in profile.modules:
            profile.modules[name].latency_s = seconds
            profile.modules[name].calls = calls
