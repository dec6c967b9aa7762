"""`from deepspeed.runtime.utils import checkpoint_activations`, as the seed document writes it:
the decorator that recomputes a block in backward (hybrid_ray/engine/activation_checkpointing.py)."""
from ..compat.names import checkpoint_activations

__all__ = ["checkpoint_activations"]
