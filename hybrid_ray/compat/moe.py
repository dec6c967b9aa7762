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
