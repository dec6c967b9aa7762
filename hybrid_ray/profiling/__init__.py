"""Profiling tools: the flops profiler (`get_model_profile`).

The measuring core lives in hybrid_ray/engine/flops.py, so the engine can profile a training step
without importing anything above it.
"""
from .model_profile import get_model_profile

__all__ = ["get_model_profile"]
