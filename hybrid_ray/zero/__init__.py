"""DeepSpeed's `deepspeed.zero` names: `Init`, `MiCS_Init`, `GatheredParameters`, `register_external_parameter`,
`ZeroParamStatus` (re-exported from hybrid_ray.compat, where they are implemented)."""
from hybrid_ray.compat.zero_gathered import GatheredParameters, ZeroParamStatus, register_external_parameter
from hybrid_ray.compat.zero_init import Init, MiCS_Init

__all__ = ["Init", "MiCS_Init", "GatheredParameters", "register_external_parameter", "ZeroParamStatus"]
