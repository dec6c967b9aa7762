"""`from deepspeed.runtime.utils import checkpoint_activations`, as the seed document writes it:
the decorator that recomputes a block in backward (hybrid_ray/engine/activation_checkpointing.py);
and `set_random_seed`, as DeepSpeed's pipeline example calls it."""
from ..compat.names import checkpoint_activations
from ..compat.pipe import set_random_seed

__all__ = ["checkpoint_activations", "set_random_seed"]
