"""`deepspeed.runtime`: the seed document's import paths (fp16.layer, utils) and DeepSpeed's
activation_checkpointing.checkpointing."""
from . import activation_checkpointing, fp16, utils  # noqa: E402,F401 - `deepspeed.runtime.utils.x` works as an attribute

__all__ = ["activation_checkpointing", "fp16", "utils"]
