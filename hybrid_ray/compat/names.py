"""The engine's classes under the names the seed document imports them by (FP16_Layer, ...)."""
from ..engine import FP16Layer, FP16Module, checkpoint_activations

FP16_Layer = FP16Layer
FP16_Module = FP16Module

__all__ = ["FP16_Layer", "FP16_Module", "checkpoint_activations"]
