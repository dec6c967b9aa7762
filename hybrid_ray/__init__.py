"""hybrid_ray: elastic mixed-precision ZeRO training on Ray.

Public names only; the engine (hybrid_ray.engine) never imports Ray or MLflow.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from .config import Config, ConfigError, NotSupportedError, load_config
from .data import build_dataloader
from .engine import (Engine, FP16Layer, FP16Module, LossScaleUnderflowError, NonFiniteGradientError,
                     Topology, checkpoint_activations, register_external_parameter)
from .profiling import Speedometer, get_model_profile

__all__ = ["initialize", "Engine", "Config", "ConfigError", "NotSupportedError", "load_config",
           "FP16Layer", "FP16Module", "Topology", "NonFiniteGradientError", "LossScaleUnderflowError",
           "checkpoint_activations", "register_external_parameter", "Speedometer", "get_model_profile"]


def initialize(model: nn.Module, model_parameters: Any = None, config: Any = None,
               optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler: Any = None,
               training_data: Any = None, loss_scaler: Any = None, *, config_params: Any = None,
               args: Any = None, collate_fn: Any = None, topology: Optional[Topology] = None,
               dist_init_required: Optional[bool] = None) -> Tuple[Engine, Any, Any, Any]:
    """Build the engine; returns (engine, optimizer, dataloader, lr_scheduler) like DeepSpeed.

    config: a path to a DeepSpeed-style JSON file, a dict, or a Config (`config_params` is the
    older DeepSpeed spelling and is accepted too; `args` and `dist_init_required` are accepted
    for signature compatibility and ignored: the process group comes from the environment).
    """
    if config is None and config_params is None:
        raise ConfigError("config: missing; got None; pass a JSON path, a dict or a Config")
    if config is not None and config_params is not None:
        raise ConfigError("config, config_params: contradiction; got both; pass one")
    engine = Engine(model, config if config is not None else config_params, model_parameters,
                    optimizer, lr_scheduler, loss_scaler, topology)
    loader = None
    if training_data is not None:
        # A sampler keyed by the global sample index: its position is resumable at any world size.
        loader = build_dataloader(training_data, engine.train_micro_batch_size_per_gpu(),
                                  engine.topology, collate_fn=collate_fn, seed=engine.config.seed or 0,
                                  global_batch=engine.train_batch_size())
        engine.training_dataloader = loader  # its data position goes into checkpoints, if it has one
    return engine, engine.optimizer, loader, engine.lr_scheduler
