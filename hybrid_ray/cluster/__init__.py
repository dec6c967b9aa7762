"""The Ray layer: worker actors own the shards, a driver scales the group and survives losses.

The engine (hybrid_ray.engine) never imports Ray; this package is the only place that does.
"""
from .config import ClusterConfigError, FailureConfig, ScalingConfig
from .context import WorkerContext, local_context
from .controller import Result, TrainingFailedError
from .policy import Decision, FailurePolicy, ScalingPolicy
from .trainer import ElasticTrainer
from .worker import StopTraining

__all__ = ["ElasticTrainer", "ScalingConfig", "FailureConfig", "ClusterConfigError", "WorkerContext",
           "local_context", "Result", "TrainingFailedError", "Decision", "ScalingPolicy",
           "FailurePolicy", "StopTraining"]
