"""Typed, strict training config: DeepSpeed-style JSON in, frozen dataclasses out.

    cfg = load_config("jobs/configs/train.json")   # or a dict, or a Config
    sizes = cfg.resolve_batch(dp_size=world_size)

Unknown keys, wrong types and out-of-range values raise ConfigError with one line naming the key
path, the value and what is allowed; settings the engine does not implement yet raise
NotSupportedError.
"""
from hybrid_ray.config.api import ConfigSource, load_config
from hybrid_ray.config.checkpoint import CheckpointConfig
from hybrid_ray.config.errors import ConfigError, NotSupportedError
from hybrid_ray.config.optim import (OptimizerConfig, SchedulerConfig, WarmupCosineLRParams,
                                     WarmupDecayLRParams, WarmupLRParams)
from hybrid_ray.config.schema import BatchSizes, Config
from hybrid_ray.config.sections import (ActivationCheckpointingConfig, BF16Config,
                                        CompressionConfig, FlopsProfilerConfig, FP16Config,
                                        OffloadConfig, PrecisionConfig, PrecisionStep, ZeroConfig)

__all__ = [
    "ActivationCheckpointingConfig", "BatchSizes", "BF16Config", "CheckpointConfig",
    "CompressionConfig", "Config", "ConfigError", "ConfigSource", "FlopsProfilerConfig",
    "FP16Config", "NotSupportedError", "OffloadConfig", "OptimizerConfig", "PrecisionConfig",
    "PrecisionStep", "SchedulerConfig", "WarmupCosineLRParams", "WarmupDecayLRParams",
    "WarmupLRParams", "ZeroConfig", "load_config",
]
