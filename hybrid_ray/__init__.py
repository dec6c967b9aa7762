"""hybrid_ray: elastic mixed-precision ZeRO training on Ray.

Public names only; the engine (hybrid_ray.engine) never imports Ray or MLflow.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from .compat.args import add_config_arguments, config_from_args
from .compat.dist import init_distributed
from .compat.engine import DeepSpeedEngine
from .compat.version import __version__
from .config import Config, ConfigError, NotSupportedError, load_config
from .data import build_dataloader
from .engine import (Engine, FP16Layer, FP16Module, LossScaleUnderflowError, NonFiniteGradientError,
                     Topology, checkpoint_activations, register_external_parameter)
from .profiling import Speedometer, get_model_profile
# DeepSpeed's subpackages, so that `import hybrid_ray as deepspeed` gives deepspeed.comm,
# deepspeed.zero, ... as DeepSpeed's own __init__ does; each only re-exports hybrid_ray.compat.
from . import accelerator, checkpointing, comm, moe, ops, pipe, runtime, utils, zero  # noqa: E402

__all__ = ["initialize", "Engine", "Config", "ConfigError", "NotSupportedError", "load_config",
           "FP16Layer", "FP16Module", "Topology", "NonFiniteGradientError", "LossScaleUnderflowError",
           "checkpoint_activations", "register_external_parameter", "Speedometer", "get_model_profile",
           "DeepSpeedEngine", "add_config_arguments", "init_distributed", "__version__"]
def initialize(model: nn.Module, model_parameters: Any = None, config: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None, training_data: Any = None,
               loss_scaler: Any = None, *, config_params: Any = None, args: Any = None,
               collate_fn: Any = None, topology: Optional[Topology] = None,
               dist_init_required: Optional[bool] = None, mpu: Any = None,
               distributed_port: Optional[int] = None, print_steps: bool = True,
               tp_plan: Any = None) -> Tuple[DeepSpeedEngine, Any, Any, Any]:
    """Build the engine; returns (engine, optimizer, dataloader, lr_scheduler) like DeepSpeed.

    Positionally (model, model_parameters, config), as the seed document writes it; DeepSpeed
    scripts pass everything by keyword (`initialize(args=args, model=net, ...)`), which works
    the same. config: a path to a DeepSpeed-style JSON file, a dict, or a Config
    (`config_params` is the older DeepSpeed spelling); without it, `args.deepspeed_config`
    (add_config_arguments adds the flag); both only when they load to the same config.
    args.local_rank must match LOCAL_RANK. optimizer / lr_scheduler: an instance, or DeepSpeed's
    callables (params -> optimizer, optimizer -> scheduler). The process group comes from the
    environment, joined through init_distributed as DeepSpeed does (a launcher's group of one
    too); `dist_init_required=False` skips that. mpu: refused unless its model-parallel world size is 1. print_steps: DeepSpeed's
    progress line every steps_per_print steps (off for callers that print their own, such as
    the LM job). tp_plan: with tensor_model_parallel_size > 1, how the model is split
    ({module-name pattern: 'colwise' | 'rowwise' | 'sequence' | a torch ParallelStyle}; default:
    the model's own tp_plan()).
    """
    if model is None:
        raise ConfigError("model: missing; got None; pass the nn.Module to train (model=...)")
    if config is not None and config_params is not None:
        raise ConfigError("config, config_params: contradiction; got both; pass one")
    config = config_from_args(args, config if config is not None else config_params)
    _check_mpu(mpu)
    if topology is None:  # DeepSpeed's initialize joins the launcher's process group first
        init_distributed(dist_init_required=dist_init_required,
                         distributed_port=distributed_port if distributed_port is not None else 29500)
    if isinstance(optimizer, torch.optim.Optimizer) or optimizer is None:
        client_optimizer = optimizer
    elif callable(optimizer):  # DeepSpeed's optimizer callable: built over the model parameters
        client_optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    else:
        raise ConfigError(f"optimizer: expected a torch.optim.Optimizer or a callable; got "
                          f"{type(optimizer).__name__}")
    # DeepSpeed's scheduler callable (optimizer -> scheduler) is built on the engine's optimizer,
    # unless the config has a scheduler (DeepSpeed's precedence too).
    factory = isinstance(lr_scheduler, type) or (callable(lr_scheduler) and not hasattr(lr_scheduler, "step"))
    engine = DeepSpeedEngine(model, config, model_parameters, client_optimizer,
                             None if factory else lr_scheduler, loss_scaler, topology,
                             print_steps=print_steps, tp_plan=tp_plan)
    if factory and engine.lr_scheduler is None:
        engine.lr_scheduler = lr_scheduler(engine.optimizer)
    loader = None
    if training_data is not None:
        # A sampler keyed by the global sample index: its position is resumable at any world size.
        loader = build_dataloader(training_data, engine.train_micro_batch_size_per_gpu(),
                                  engine.topology, collate_fn=collate_fn, seed=engine.config.seed or 0,
                                  global_batch=engine.train_batch_size())
        engine.training_dataloader = loader  # its data position goes into checkpoints, if it has one
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _check_mpu(mpu: Any) -> None:
    if mpu is None:
        return
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size",
                 "get_pipeline_model_parallel_world_size"):
        size = getattr(mpu, name, None)
        if size is not None and size() > 1:
            raise NotSupportedError(f"mpu: {name}() = {size()}: model parallelism through an mpu "
                                    "is not supported yet; pass mpu=None")
