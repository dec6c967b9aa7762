"""`deepspeed.ops`: the Adam optimizers scripts import from `deepspeed.ops.adam`."""
from . import adam

__all__ = ["adam"]
