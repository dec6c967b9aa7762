"""The Ray layer: worker actors own the shards, a driver scales the group and survives losses.

The engine (hybrid_ray.engine) never imports Ray; this package is the only place that does, and
it knows no job (the LM job's driver is hybrid_ray.lm.elastic). The names below load on first
use, so the Ray-free parts (policy.py, compression_policy.py, compression_follower.py,
records.py) import without Ray: a training loop under torchrun uses some of them.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ElasticTrainer": ".trainer", "Result": ".controller", "TrainingFailedError": ".controller",
    "WorkerContext": ".context", "local_context": ".context", "StopTraining": ".context",
    "Decision": ".policy", "FailurePolicy": ".policy", "ScalingPolicy": ".policy",
    "ScalingConfig": "hybrid_ray.config.cluster", "FailureConfig": "hybrid_ray.config.cluster",
    "ClusterConfigError": "hybrid_ray.config.cluster",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_WHERE))
