"""DeepSpeed's import path `deepspeed.profiling.flops_profiler`, with the package renamed.

Like DeepSpeed's, `get_model_profile` returns three values, `(flops, macs, params)`. Code that
unpacks two (`flops, params = get_model_profile(...)`) raises "too many values to unpack" under
DeepSpeed as well; write `flops, macs, params = ...` instead.
"""
from .model_profile import get_model_profile

__all__ = ["get_model_profile"]
