"""`from deepspeed.moe.layer import MoE`: importable, refused when built (no expert parallelism)."""
from ..compat.moe import MoE

__all__ = ["MoE"]
