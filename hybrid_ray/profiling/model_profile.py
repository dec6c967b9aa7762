"""`get_model_profile`: flops, MACs and parameters of a model, with a per-module table."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from hybrid_ray.engine.flops.counter import (FlopsCapture, LatencyTimer, Profile, add_latency,
                                             batch_shape, clock)
from hybrid_ray.engine.flops.report import format_report, si

Number = Union[int, str]


def get_model_profile(model: nn.Module, input_shape: Optional[Sequence[int]] = None,
                      args: Optional[Sequence[Any]] = None, kwargs: Optional[Dict[str, Any]] = None,
                      print_per_layer_stat: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 3, warm_up: int = 1,
                      as_string: bool = False, output_file: Optional[str] = None,
                      backward: bool = False) -> Tuple[Number, Number, Number]:
    """Profile one forward of `model` (and its backward with backward=True); (flops, macs, params).

    input_shape: build one random input of this shape, in the dtype and on the device of the
      model's first parameter (a model taking token ids gets `args` instead).
    args/kwargs: the inputs to call the model with.
    print_per_layer_stat: print the report; detailed: include the per-module table, down to
      module_depth (-1: all levels); top_modules: modules listed per depth in the summary.
    warm_up: forwards run first, so the timed pass does not pay one-off costs.
    as_string: return '12.3 GFLOPs'-style strings instead of integers.
    output_file: also write the report to this file.
    backward: also count and time a backward of the sum of the floating outputs.

    Flops are torch.utils.flop_counter's (matmul, convolution, attention; elementwise ops are not
    counted); MACs are flops / 2 for those ops. Parameters count every parameter of the model.
    """
    call_args, call_kwargs = _inputs(model, input_shape, args, kwargs)
    device_type = _device_type(model, call_args, call_kwargs)
    saved_grads = {p: p.grad for p in model.parameters()}
    try:
        with torch.set_grad_enabled(backward):
            for _ in range(warm_up):
                model(*call_args, **call_kwargs)
            profile = _count(model, call_args, call_kwargs, backward)
            _time(model, call_args, call_kwargs, backward, device_type, profile)
    finally:
        for p, grad in saved_grads.items():  # leave the model's gradients as they were
            p.grad = grad
    profile.samples, profile.tokens_per_sample = batch_shape(call_args, call_kwargs)
    profile.title = "forward + backward" if backward else "forward"
    text = format_report(profile, module_depth, top_modules, detailed)
    if print_per_layer_stat:
        print(text, end="", flush=True)
    if output_file:
        with open(output_file, "w", encoding="utf-8") as f:
            f.write(text)
    if as_string:
        return si(profile.flops, "FLOPs"), si(profile.macs, "MACs"), si(profile.params)
    return profile.flops, profile.macs, profile.params


def _inputs(model: nn.Module, input_shape: Optional[Sequence[int]], args: Optional[Sequence[Any]],
            kwargs: Optional[Dict[str, Any]]) -> Tuple[tuple, dict]:
    if input_shape is not None and args:
        raise ValueError("get_model_profile: pass input_shape or args, not both")
    if input_shape is None and not args and not kwargs:
        raise ValueError("get_model_profile: no input; pass input_shape=(batch, ...) or args/kwargs")
    if input_shape is not None:
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        return (torch.randn(tuple(input_shape), dtype=dtype, device=device),), dict(kwargs or {})
    return tuple(args or ()), dict(kwargs or {})


def _device_type(model: nn.Module, args: tuple, kwargs: dict) -> str:
    for t in list(model.parameters()) + [v for v in list(args) + list(kwargs.values())
                                         if isinstance(v, torch.Tensor)]:
        return t.device.type
    return "cpu"


def _backward_of(out: Any) -> None:
    """Backpropagate the sum of every floating output that needs a gradient."""
    leaves = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    if leaves:
        torch.stack([t.float().sum() for t in leaves]).sum().backward()


def _tensors(obj: Any) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _count(model: nn.Module, args: tuple, kwargs: dict, backward: bool) -> Profile:
    capture = FlopsCapture(model)
    capture.start()
    try:
        out = model(*args, **kwargs)
        capture.mark_forward_done()
        if backward:
            _backward_of(out)
    finally:
        totals = capture.stop()
    return capture.build(totals, capture.forward_counts)


def _time(model: nn.Module, args: tuple, kwargs: dict, backward: bool, device_type: str,
          profile: Profile) -> None:
    timer = LatencyTimer(model, device_type)
    timer.start()
    try:
        t0 = clock(device_type)
        out = model(*args, **kwargs)
        profile.forward_s = clock(device_type) - t0
    finally:
        add_latency(profile, timer.stop())
    if backward:
        t0 = clock(device_type)
        _backward_of(out)
        profile.backward_s = clock(device_type) - t0
