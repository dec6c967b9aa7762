"""Profiling tools: the flops profiler (`get_model_profile`) and the training `Speedometer`.

The measuring core lives in hybrid_ray/engine/flops/, so the engine can profile a training step
without importing anything above it.
"""
from .model_profile import get_model_profile
from .peaks import PEAK_FLOPS, peak_flops
from .speedometer import Speedometer, format_record

__all__ = ["get_model_profile", "Speedometer", "format_record", "PEAK_FLOPS", "peak_flops"]
