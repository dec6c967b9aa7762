"""`load_config`: a path, dict or Config in; a validated, supported Config out."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Union

from hybrid_ray.config.bounds import MAX_DEPTH, check_bounds, parse_int, too_deep_position
from hybrid_ray.config.errors import ConfigError, NotSupportedError, config_error
from hybrid_ray.config.legacy import normalise
from hybrid_ray.config.loader import load_dataclass
from hybrid_ray.config.schema import Config, check_batch

ConfigSource = Union[str, os.PathLike, Mapping[str, Any], Config]


def load_config(source: ConfigSource, *, fixed_global_batch: bool = False) -> Config:
    """Load and validate a config from a JSON file path, a dict, or return a Config as is.

    Raises ConfigError for anything invalid and NotSupportedError (a ConfigError) for valid
    settings the engine does not implement yet; whatever the input, nothing else (any other
    value than a path, dict or Config is refused as a config that is not a JSON object).
    Batch sizes that no data-parallel size can satisfy are refused here; the check for one
    size is `Config.resolve_batch(dp_size)`, at engine start. fixed_global_batch: the LM job's
    rule (lm/job.for_world), where train_batch_size holds at every world size and the
    micro-batch is an upper bound, so only a config with no batch size at all is refused.
    """
    if isinstance(source, Config):
        return source
    if isinstance(source, (str, os.PathLike)):
        raw: Any = read_json(Path(source))
    else:
        raw = source
        check_bounds(raw)
    cfg = load_dataclass(Config, normalise(raw), "")
    _check_supported(cfg)
    check_batch(cfg, fixed_global_batch)
    return cfg


def replace_section(cfg: Config, key: str, raw: Any) -> Config:
    """`cfg` with top-level section `key` replaced by `raw` (JSON-like, as in a config file),
    validated exactly as load_config validates a whole config (errors name `key.<field>`)."""
    return load_config({**cfg.to_dict(), key: raw})


def read_json(path: Path) -> Any:
    """Parse a JSON file; every failure is a one-line ConfigError that names the file (or, for
    a value past the limits of bounds.py, the key path)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found", str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc})", str(path)) from None
    try:
        raw = json.loads(text, object_pairs_hook=_reject_duplicates, parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}", str(path)) from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}", str(path)) from None
    except RecursionError:  # json's parser recurses per level: thousands overflow the stack
        line, column = too_deep_position(text)
        raise ConfigError(f"{path}: nested too deeply at line {line} column {column}; allowed: "
                          f"at most {MAX_DEPTH} levels of objects and lists", str(path)) from None
    check_bounds(raw)
    return raw


def _reject_duplicates(pairs: list) -> dict:
    # json keeps the last of two equal keys silently; in a config that is always a mistake.
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r} in one JSON object")
        out[key] = value
    return out


def _refuse(unsupported: bool, path: str, got: object, allowed: str) -> None:
    if unsupported:
        raise config_error(path, "not supported yet", got, allowed, cls=NotSupportedError)


def _check_supported(cfg: Config) -> None:
    """Refuse schema features the engine does not implement yet, first one found.

    One statement per feature: the work that implements a feature deletes its line here.
    """
    zero, ac = cfg.zero_optimization, cfg.activation_checkpointing
    _refuse(zero.offload_optimizer.device == "nvme", "zero_optimization.offload_optimizer.device",
            zero.offload_optimizer.device, "allowed: 'none', 'cpu' (nvme offload is planned)")
    _refuse(zero.offload_param.device != "none", "zero_optimization.offload_param.device",
            zero.offload_param.device, "allowed: 'none' (parameter offload is planned)")
    _refuse(zero.zero_hpz_partition_size > 1, "zero_optimization.zero_hpz_partition_size",
            zero.zero_hpz_partition_size, "allowed: 1 (ZeRO++ hierarchical partitioning is not "
            "supported)")
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        _refuse(getattr(zero, key), f"zero_optimization.{key}", True,
                "allowed: false (ZeRO++ quantized communication is not supported)")
    _refuse(ac.partition_activations, "activation_checkpointing.partition_activations",
            ac.partition_activations, "allowed: false (checkpointed activations are not split "
            "across ranks under tensor parallelism; a tp_plan's 'sequence' entries split the activations instead)")
    _refuse(cfg.fp16.fp16_master_weights_and_grads, "fp16.fp16_master_weights_and_grads", True,
            "allowed: false (master weights and gradients are fp32)")
    _refuse(cfg.sparse_gradients, "sparse_gradients", True,
            "allowed: false (embedding gradients are reduced densely in the flat buckets)")
    _refuse(cfg.amp.enabled, "amp.enabled", True, "allowed: false (apex AMP is not supported: "
            "use fp16.enabled or bf16.enabled)")
    _refuse(cfg.elasticity.enabled, "elasticity.enabled", True, "allowed: false (elastic scaling "
            "is done by the Ray driver: hybrid-ray train --min-workers/--workers)")
    for monitor in ("tensorboard", "wandb", "csv_monitor"):
        _refuse(getattr(cfg, monitor).enabled, f"{monitor}.enabled", True,
                "allowed: false (metrics are recorded in MLflow: hybrid_ray.tracking)")

