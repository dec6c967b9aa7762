"""`from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec` (hybrid_ray/compat/pipe.py)."""
from ..compat.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
