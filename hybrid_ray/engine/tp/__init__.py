"""Tensor parallelism: a plan of module-name patterns (plan.py) applied through torch's
parallelize_module, leaving plain local-shard parameters for ZeRO (local.py)."""
from .local import TensorParallelModel, apply_plan
from .plan import STYLE_NAMES, FusedColwise, resolve_plan

__all__ = ["FusedColwise", "STYLE_NAMES", "TensorParallelModel", "apply_plan", "resolve_plan"]
