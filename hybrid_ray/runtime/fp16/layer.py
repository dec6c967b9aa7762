"""`from deepspeed.runtime.fp16.layer import FP16_Layer, FP16_Module`, as the seed document
writes it: the engine's FP16Layer (one layer computes in fp16) and FP16Module (a base class
for modules that pick their own precision)."""
from ...compat.names import FP16_Layer, FP16_Module

__all__ = ["FP16_Layer", "FP16_Module"]
