"""`deepspeed.utils`: zero_to_fp32 (a checkpoint's consolidated fp32 weights) and RepeatingLoader."""
from ..compat.pipe import RepeatingLoader

__all__ = ["RepeatingLoader"]
