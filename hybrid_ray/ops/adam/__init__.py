"""`from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam` (hybrid_ray/compat/optimizers.py)."""
from ...compat.optimizers import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
