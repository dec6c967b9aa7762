"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing API over torch's.

`checkpoint(function, *args)` runs `function` without keeping its intermediate activations and
recomputes them in backward (torch.utils.checkpoint, non-reentrant, through the engine's
`checkpoint_call`). `configure(...)` takes DeepSpeed's settings: what changes results or
memory here is honoured (checkpoint_in_cpu keeps the saved inputs in host memory, synchronize
synchronises the device at each boundary), what is only a memory-layout or timing aid
(contiguous_checkpointing, num_checkpoints, profile) is accepted with a warning that it has no
effect, and partition_activations (needs tensor parallelism) or a model-parallel `mpu_` with
more than one rank is refused with NotSupportedError.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from ..config import NotSupportedError, load_config
from ..engine.activation_checkpointing import CheckpointOptions, checkpoint_call


@dataclass(frozen=True)
class Settings:
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings: Optional[Settings] = None
_NO_EFFECT = {"contiguous_checkpointing": "torch's allocator reuses the freed activation memory",
              "num_checkpoints": "only sizes the contiguous buffer",
              "profile": "use torch.profiler to time forward and recompute"}


def _from_config(deepspeed_config: Any) -> Settings:
    """The `activation_checkpointing` section of a DeepSpeed config (path, dict or Config)."""
    if deepspeed_config is None:
        return Settings()
    ac = load_config(deepspeed_config).activation_checkpointing
    return Settings(ac.partition_activations, ac.contiguous_memory_optimization,
                    ac.number_checkpoints, ac.cpu_checkpointing, ac.synchronize_checkpoint_boundary,
                    ac.profile)


def _check_mpu(mpu_: Any) -> None:
    if mpu_ is None:
        return
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        size = getattr(mpu_, name, None)
        if size is not None and size() > 1:
            raise NotSupportedError(f"checkpointing.configure: mpu_ with {name}() = {size()}: model "
                                    "parallelism is not supported yet; pass mpu_=None")


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Set how `checkpoint` stores activations; arguments override the config's section."""
    global _settings
    _check_mpu(mpu_)
    given = {"partition_activations": partition_activations,
             "contiguous_checkpointing": contiguous_checkpointing, "num_checkpoints": num_checkpoints,
             "checkpoint_in_cpu": checkpoint_in_cpu, "synchronize": synchronize, "profile": profile}
    settings = replace(_from_config(deepspeed_config), **{k: v for k, v in given.items() if v is not None})
    if settings.partition_activations:
        raise NotSupportedError("checkpointing.configure: partition_activations=True is not supported "
                                "yet (partitioning activations across ranks needs tensor parallelism)")
    for key, why in _NO_EFFECT.items():
        if getattr(settings, key) not in (None, False):
            warnings.warn(f"checkpointing.configure: {key}={getattr(settings, key)!r} accepted for "
                          f"DeepSpeed compatibility, no effect here ({why})", stacklevel=2)
    _settings = settings


def is_configured() -> bool:
    return _settings is not None


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; nothing is kept between steps here."""


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    if partition_activation:
        raise NotSupportedError("checkpointing: partition_activations is not supported yet "
                                "(it needs tensor parallelism)")


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed sizes its contiguous buffer with this; no effect here."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """function(*args), its activations recomputed in backward instead of stored."""
    settings = _settings or Settings()
    if settings.synchronize:
        _sync()
    out = checkpoint_call(function, args, {}, CheckpointOptions(cpu_checkpointing=settings.checkpoint_in_cpu))
    if settings.synchronize:
        _sync()
    return out


non_reentrant_checkpoint = checkpoint  # DeepSpeed's second entry point; this one already is
