"""The seed's import path, mirroring `deepspeed.profiling.flops_profiler`.

Like DeepSpeed's, `get_model_profile` returns three values, `(flops, macs, params)`. The seed's
section 5.2 unpacks two (`flops, params = get_model_profile(...)`), which raises "too many values
to unpack" under DeepSpeed as well; write `flops, macs, params = ...` instead.
"""
from .model_profile import get_model_profile

__all__ = ["get_model_profile"]
