"""`deepspeed.accelerator`: get_accelerator() for CUDA or the CPU (hybrid_ray/compat/accelerator.py)."""
from ..compat.accelerator import Accelerator, get_accelerator

__all__ = ["Accelerator", "get_accelerator"]
