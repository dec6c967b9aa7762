"""The `optimizer` and `scheduler` sections.

Optimizer params are checked against the torch optimizer's own signature, so a new torch keyword
is accepted without a schema change and a typo (`lrr`) is caught before any GPU is allocated.
Scheduler params are typed per scheduler type (DeepSpeed's WarmupLR, WarmupDecayLR,
WarmupCosineLR); the type picks which dataclass `params` loads into.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from hybrid_ray.config.errors import Verbatim, config_error, join_path, unknown_key_error
from hybrid_ray.config.loader import check_range, checked, load_dataclass, load_value

OptimizerType = Literal["AdamW", "Adam", "SGD"]
DEFAULT_OPTIMIZER = "AdamW"
# Keywords that pick a kernel implementation: the engine decides these from the device and its
# flat-buffer layout, and a config that forces one would silently fight that choice.
ENGINE_CHOSEN = ("fused", "foreach", "capturable", "differentiable")
# DeepSpeed's own Adam keys: read here (they pick DeepSpeed's implementation and its weight
# decay), never passed to torch. torch_adam only picks the implementation (torch's or DeepSpeed's
# fused kernel; the engine always uses torch.optim); adam_w_mode must agree with the type.
_DEEPSPEED_ONLY = {
    "adam_w_mode": "DeepSpeed's Adam decay switch; must agree with type ('AdamW': true, 'Adam': false)",
    "torch_adam": "DeepSpeed's choice of Adam kernel; the engine always uses torch.optim",
}
_ADAM_W_MODE = {"AdamW": True, "Adam": False}
# Ranges torch would enforce anyway at construction; checked here so the error names the key.
_PARAM_RANGES = {"lr": {"ge": 0}, "eps": {"ge": 0}, "weight_decay": {"ge": 0},
                 "momentum": {"ge": 0}, "dampening": {"ge": 0}}


@functools.lru_cache(maxsize=None)
def optimizer_params_schema(kind: str) -> dict:
    """{param name: type hint} for torch.optim.<kind>, from its signature (minus `params`)."""
    import torch  # deferred: config parsing on a Ray driver should not pay for torch until needed

    sig = inspect.signature(getattr(torch.optim, kind))
    return {name: _param_hint(p) for name, p in sig.parameters.items() if name != "params"}


def _param_hint(p: inspect.Parameter) -> Any:
    """Type hint for one optimizer keyword, read off its default (annotations vary by version)."""
    default = p.default
    if isinstance(default, bool):
        return bool
    if isinstance(default, (int, float)):
        return float  # torch defaults like weight_decay=0 are ints but mean floats
    if isinstance(default, tuple):
        return tuple.__class_getitem__((float,) * len(default))
    annotation = str(p.annotation)
    if "bool" in annotation:
        return Optional[bool]
    if "float" in annotation:
        return float
    return object


def _load_optimizer_params(raw: Any, path: str, loaded: dict) -> dict:
    """Convert hook for OptimizerConfig.params: validate names, types and ranges per torch class."""
    schema = optimizer_params_schema(loaded.get("type", DEFAULT_OPTIMIZER))
    params = load_value(dict[str, object], raw, path)
    out = {}
    for name, value in params.items():
        ppath = join_path(path, name)
        if name in ENGINE_CHOSEN:
            raise config_error(ppath, "not configurable", value,
                               "the engine chooses the optimizer implementation itself")
        if name in _DEEPSPEED_ONLY:
            _check_deepspeed_key(name, value, ppath, loaded.get("type", DEFAULT_OPTIMIZER))
            continue
        if name not in schema:
            raise unknown_key_error(path, name, [k for k in schema if k not in ENGINE_CHOSEN])
        out[name] = load_value(schema[name], value, ppath)
        check_range(out[name], ppath, **_PARAM_RANGES.get(name, {}))
    for i, beta in enumerate(out.get("betas", ())):
        check_range(beta, f"{join_path(path, 'betas')}[{i}]", ge=0, lt=1)
    _check_nesterov(out, path)
    return out


def _check_deepspeed_key(name: str, value: Any, path: str, kind: str) -> None:
    """torch_adam: any boolean for Adam/AdamW; adam_w_mode: only the value the type means."""
    if kind not in _ADAM_W_MODE:
        raise config_error(path, "unknown key", value, f"{_DEEPSPEED_ONLY[name]} (Adam/AdamW only)")
    if not isinstance(value, bool):
        raise config_error(path, "expected a boolean", value)
    if name == "adam_w_mode" and value != _ADAM_W_MODE[kind]:
        want = "AdamW" if value else "Adam"
        raise config_error(path, "contradiction", Verbatim(f"{str(value).lower()} with type {kind!r}"),
                           f"DeepSpeed's Adam with adam_w_mode {str(value).lower()} is torch's "
                           f"{want}: set type {want!r} (and drop adam_w_mode)")


def _check_nesterov(params: dict, path: str) -> None:
    """torch's SGD refuses Nesterov momentum without momentum or with dampening; refused here
    first so the error names the key (only SGD's signature has `nesterov`)."""
    momentum, dampening = params.get("momentum", 0.0), params.get("dampening", 0.0)
    if params.get("nesterov") and (momentum <= 0 or dampening != 0):
        raise config_error(join_path(path, "nesterov"), "needs momentum > 0 and dampening 0",
                           Verbatim(f"true with momentum {momentum}, dampening {dampening}"),
                           f"set {join_path(path, 'momentum')} > 0 and dampening 0, or "
                           f"nesterov false")


@dataclass(frozen=True)
class OptimizerConfig:
    """Which torch optimizer runs on the fp32 master weights, and its keyword arguments."""

    type: OptimizerType = checked(DEFAULT_OPTIMIZER, case_insensitive=True)
    """torch.optim class; matched ignoring case, stored in torch's spelling."""
    params: dict[str, Any] = checked(default_factory=dict, convert=_load_optimizer_params)
    """Keyword arguments for the torch class (lr, betas, eps, weight_decay, ...); omitted ones
    take torch's defaults. `betas` is stored as a tuple."""


@dataclass(frozen=True, kw_only=True)
class WarmupLRParams:
    """DeepSpeed WarmupLR: ramp from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: float = checked(0.0, ge=0)
    """Learning rate at step 0."""
    warmup_max_lr: float = checked(0.001, ge=0)
    """Learning rate reached at the end of warmup."""
    warmup_num_steps: int = checked(1000, ge=0)
    """Number of optimizer steps the warmup lasts."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup ramp."""


def _check_total_after_warmup(params: Any, path: str) -> None:
    """A decay phase needs total_num_steps > warmup_num_steps (equal divides by zero)."""
    if params.total_num_steps <= params.warmup_num_steps:
        raise config_error(
            f"{path}.total_num_steps, {path}.warmup_num_steps", "contradiction",
            Verbatim(f"{params.total_num_steps} <= {params.warmup_num_steps}"),
            "need total_num_steps > warmup_num_steps (warmup_num_steps defaults to 1000)")


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    """DeepSpeed WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: int = checked(ge=1)
    """Step at which the learning rate reaches 0 (required)."""

    def validate(self, path: str) -> None:
        """Cross-field check: the decay phase must have at least one step."""
        _check_total_after_warmup(self, path)


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLRParams:
    """DeepSpeed WarmupCosineLR: warmup as a ratio of the optimizer lr, then cosine decay."""

    total_num_steps: int = checked(ge=1)
    """Step at which the cosine decay ends (required)."""
    warmup_min_ratio: float = checked(0.0, ge=0, le=1)
    """Fraction of the optimizer lr at step 0."""
    warmup_num_steps: int = checked(1000, ge=0)
    """Number of optimizer steps the warmup lasts."""
    cos_min_ratio: float = checked(0.0001, ge=0, le=1)
    """Fraction of the optimizer lr at the end of the cosine decay."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup ramp."""

    def validate(self, path: str) -> None:
        """Cross-field check: the cosine phase must have at least one step."""
        _check_total_after_warmup(self, path)


SCHEDULER_PARAMS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                    "WarmupCosineLR": WarmupCosineLRParams}
SchedulerParams = Union[WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams]


def _load_scheduler_params(raw: Any, path: str, loaded: dict) -> SchedulerParams:
    """Convert hook for SchedulerConfig.params: the already-loaded type picks the dataclass."""
    return load_dataclass(SCHEDULER_PARAMS[loaded["type"]], raw, path)


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule stepped once per optimizer step."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = checked(case_insensitive=True)
    """DeepSpeed scheduler name (required when the section is present)."""
    params: SchedulerParams = checked(convert=_load_scheduler_params, absent={})
    """The scheduler's settings; which keys are valid depends on `type`."""
