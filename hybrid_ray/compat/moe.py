"""`deepspeed.moe.layer.MoE`: importable, so that scripts which import it for an optional
expert layer still load; building one is refused (there is no expert parallelism here)."""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..config import NotSupportedError


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer: not supported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(
            "deepspeed.moe.layer.MoE: mixture-of-experts layers (expert parallelism, gating, "
            "all-to-all dispatch) are not supported by hybrid_ray; build the experts as ordinary "
            "modules (they then train data-parallel like the rest of the model)")


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: Any = None) -> list:
    """DeepSpeed's `moe.utils` helper: moves expert parameters (those marked `allreduce=False`
    by an MoE layer) into groups of their own. No MoE layer can be built here, so no parameter
    is an expert's: the groups come back as a list, a single group dict as a one-element list."""
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (tuple, list)):
        return list(param_groups)
    raise ValueError(f"unknown type for param_groups: {type(param_groups).__name__}")
