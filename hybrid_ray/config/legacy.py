"""Older DeepSpeed spellings, rewritten to the current ones before the schema reads a config.

DeepSpeed still reads them (with a deprecation warning), and configs in the wild still use them:
- `"zero_optimization": true / false` means stage 1 / stage 0;
- `zero_optimization.cpu_offload: true` means `offload_optimizer.device: "cpu"`
  (`cpu_offload_params` the same for `offload_param`, `cpu_offload_use_pin_memory` sets
  `offload_optimizer.pin_memory`);
- `zero_optimization.stage3_gather_fp16_weights_on_model_save` is the older name of
  `stage3_gather_16bit_weights_on_model_save`.
- `"optimizer": {"type": "OneBitAdam", "params": {..., "freeze_step": N}}` (DeepSpeed's 1-bit
  Adam, an optimizer there) is AdamW with `gradient_compression: {"type": "onebit",
  "warmup_steps": N}` here: the compression is the reducer's, the frozen variance the step's.
  Its `cuda_aware` and `comm_backend_name` pick DeepSpeed's transport and are dropped, as is
  `bias_correction`: the update is torch's AdamW's, bias corrections included.
An old spelling beside a new one that says otherwise is a contradiction (ConfigError).
"""
from __future__ import annotations

from typing import Any, Mapping

from hybrid_ray.config.errors import NotSupportedError, Verbatim, config_error

_ZERO = "zero_optimization"
_RENAMED = {"stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}


_ONEBIT_DEFAULT_FREEZE = 100000  # DeepSpeed's OneBitAdam default freeze_step
_DROPPED_ONEBIT_KEYS = ("cuda_aware", "comm_backend_name", "bias_correction")


def normalise(raw: Any) -> Any:
    """`raw` with the old spellings replaced (a copy; anything but a dict passes through)."""
    if not isinstance(raw, Mapping):
        return raw
    raw = _onebit_optimizer(raw)
    if _ZERO not in raw:
        return raw
    zero = raw[_ZERO]
    if isinstance(zero, bool):
        return {**raw, _ZERO: {"stage": 1 if zero else 0}}
    if not isinstance(zero, Mapping):
        return raw
    zero = dict(zero)
    for old, new in _RENAMED.items():
        if old in zero:
            _move(zero, old, new)
    _offload_flag(zero, "cpu_offload", "offload_optimizer")
    _offload_flag(zero, "cpu_offload_params", "offload_param")
    if "cpu_offload_use_pin_memory" in zero:
        pin = _flag(zero.pop("cpu_offload_use_pin_memory"), "cpu_offload_use_pin_memory")
        section = _section(zero, "offload_optimizer")
        if "pin_memory" in section and section["pin_memory"] != pin:
            raise _contradiction("cpu_offload_use_pin_memory", f"offload_optimizer.pin_memory",
                                 pin, section["pin_memory"])
        zero["offload_optimizer"] = {**section, "pin_memory": pin}
    return {**raw, _ZERO: zero}


def _move(zero: dict, old: str, new: str) -> None:
    value = zero.pop(old)
    if new in zero and zero[new] != value:
        raise _contradiction(old, new, value, zero[new])
    zero[new] = value


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise config_error(f"{_ZERO}.{key}", "expected a boolean", value,
                           "the older spelling of the offload sections: true or false")
    return value


def _section(zero: dict, name: str) -> dict:
    section = zero.get(name)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise config_error(f"{_ZERO}.{name}", "expected an object", section)
    return dict(section)


def _offload_flag(zero: dict, key: str, section_name: str) -> None:
    """true -> section.device 'cpu'; false says nothing (DeepSpeed's reading too)."""
    if key not in zero:
        return
    if not _flag(zero.pop(key), key):
        return
    section = _section(zero, section_name)
    device = section.get("device", "cpu")
    if device != "cpu":
        raise _contradiction(key, f"{section_name}.device", True, device)
    zero[section_name] = {**section, "device": "cpu"}


def _contradiction(old: str, new: str, old_value: Any, new_value: Any) -> Exception:
    return config_error(f"{_ZERO}.{old}, {_ZERO}.{new}", "contradiction",
                        Verbatim(f"{old_value!r} and {new_value!r}"),
                        f"{old} is the older spelling of {new}: set only {new}")


def _onebit_optimizer(raw: Mapping) -> Mapping:
    """DeepSpeed's 1-bit optimizers as AdamW plus onebit compression (or a one-line refusal)."""
    opt = raw.get("optimizer")
    kind = opt.get("type") if isinstance(opt, Mapping) else None
    if not isinstance(kind, str) or kind.lower() not in ("onebitadam", "zerooneadam", "onebitlamb"):
        return raw
    if kind.lower() != "onebitadam":
        raise config_error("optimizer.type", "not supported", kind, "OneBitAdam (1-bit Adam, with any "
                           "ZeRO stage), or AdamW with gradient_compression onebit", cls=NotSupportedError)
    params = dict(opt.get("params") or {})
    for key in _DROPPED_ONEBIT_KEYS:
        params.pop(key, None)
    freeze = params.pop("freeze_step", _ONEBIT_DEFAULT_FREEZE)
    gc = raw.get("gradient_compression")
    if isinstance(gc, Mapping) and gc.get("type", "none") not in ("none", "onebit"):
        raise config_error("optimizer.type, gradient_compression.type", "contradiction",
                           Verbatim(f"OneBitAdam with {gc.get('type')!r}"),
                           "OneBitAdam is onebit compression: drop one of them")
    gc = {"warmup_steps": freeze, **(dict(gc) if isinstance(gc, Mapping) else {}), "type": "onebit"}
    return {**raw, "optimizer": {**opt, "type": "AdamW", "params": params}, "gradient_compression": gc}
