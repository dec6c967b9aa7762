"""`from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer`."""
from ..compat.moe import split_params_into_different_moe_groups_for_optimizer

__all__ = ["split_params_into_different_moe_groups_for_optimizer"]
