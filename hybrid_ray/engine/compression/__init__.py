"""Gradient compression for the data-parallel reduction (config `gradient_compression`).

fp16/bf16 need no compressor: they set the reducer's reduction dtype (`reduction_setup`).
topk.py sends each bucket's largest entries, powersgd.py low-rank factors of its matrices,
onebit.py one bit per element (1-bit Adam, with the variance frozen in zero/frozen.py); all
build on base.py (bucket keys, layouts, error-feedback residuals). stats.py times the reduction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..precision import dtype_of
from .base import BucketKey, ErrorFeedback, Layout
from .codec import PairCodec
from .onebit import OneBit
from .onebit_momentum import OneBitMomentum
from .powersgd import PowerSGD
from .stats import CommStats, StepTimer
from .topk import TopK

__all__ = ["BucketKey", "CommStats", "ErrorFeedback", "Layout", "OneBit", "OneBitMomentum", "PairCodec",
           "PowerSGD", "Reduction", "StepTimer", "TopK", "build_compressor", "reduction_setup"]


@dataclass(frozen=True)
class Reduction:
    """How a bucket's gradients travel: reduced in `dtype`, or exchanged by `compressor` (values
    in fp32); `dense_dtype` is what the uncompressed reduction would carry, the baseline of
    CommStats' byte ratio (None: `dtype`)."""

    dtype: torch.dtype = torch.float32
    compressor: Optional[ErrorFeedback] = None
    dense_dtype: Optional[torch.dtype] = None


def build_compressor(gc, momentum_obstacle: str = "") -> Optional[ErrorFeedback]:
    """The compressor for a `gradient_compression` section (None: a dense reduction);
    `momentum_obstacle`: why onebit's momentum form cannot run here ('' if it can)."""
    if gc.type == "topk":
        return TopK(gc.topk_ratio, gc.warmup_steps, gc.error_feedback, PairCodec(gc.topk_values, gc.topk_indices))
    if gc.type == "powersgd":
        return PowerSGD(gc.rank, gc.warmup_steps, gc.error_feedback)
    if gc.type == "onebit":
        momentum = gc.form == "momentum" or (gc.form == "auto" and not momentum_obstacle)
        return (OneBitMomentum if momentum else OneBit)(gc.warmup_steps, gc.error_feedback, gc.update_bound)
    return None


def reduction_setup(config) -> Reduction:
    """The Reduction a Config asks for.

    fp16/bf16 compression is a half-precision reduction (the config refuses a contradiction
    with communication_data_type); the uncompressed dtype is the baseline of the byte ratio.
    """
    gc, comm_dtype = config.gradient_compression, config.communication_data_type
    dense = dtype_of(comm_dtype or "fp32")
    reduce = dtype_of(gc.type) if gc.type in ("fp16", "bf16") else dense
    return Reduction(reduce, build_compressor(gc, config.onebit_momentum_obstacle()), dense)
