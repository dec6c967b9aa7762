"""`deepspeed.pipe` and the helpers DeepSpeed's pipeline scripts import from `deepspeed.utils`
and `deepspeed.runtime.utils`: PipelineModule and its layer specs (hybrid_ray/engine/pipe/),
RepeatingLoader, set_random_seed."""
from __future__ import annotations

import random

import numpy as np
import torch

from ..engine.pipe import LayerSpec, PipelineModule, RepeatingLoader, TiedLayerSpec


def set_random_seed(seed: int) -> None:
    """DeepSpeed's `runtime.utils.set_random_seed`: Python's, numpy's and torch's generators
    (every CUDA device's too) seeded with `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "RepeatingLoader", "set_random_seed"]
