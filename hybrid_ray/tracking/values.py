"""Turning configs and records into what MLflow accepts: flat params, numeric metrics, valid keys."""
from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any, Dict, Mapping, Optional

from mlflow.utils.validation import (MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH,
                                     MAX_TAG_VAL_LENGTH)

from ..config.loader import flatten

_BAD_KEY_CHARS = re.compile(r"[^\w\-. /]")  # MLflow keys: word characters, - . space /
_ELLIPSIS = "..."


def key(name: Any) -> str:
    """A valid MLflow key: other characters become '_', the length is capped."""
    return _BAD_KEY_CHARS.sub("_", str(name))[:MAX_ENTITY_KEY_LENGTH]


def clip(text: str, limit: int) -> str:
    """Cut `text` to `limit` characters, marking the cut (MLflow refuses longer values)."""
    return text if len(text) <= limit else text[:limit - len(_ELLIPSIS)] + _ELLIPSIS


def param_value(value: Any) -> str:
    return clip("None" if value is None else str(value), MAX_PARAM_VAL_LENGTH)


def tag_value(value: Any) -> str:
    return clip(str(value), MAX_TAG_VAL_LENGTH)


def flat_params(params: Any) -> Dict[str, str]:
    """{'zero_optimization.stage': '2', ...} from a Config, a dataclass or a nested mapping."""
    if hasattr(params, "flat_dict"):  # hybrid_ray Config
        plain: Mapping = params.flat_dict()
    elif dataclasses.is_dataclass(params) and not isinstance(params, type):
        plain = flatten(dataclasses.asdict(params))
    elif isinstance(params, Mapping):
        plain = flatten({str(k): v for k, v in params.items()})
    else:
        raise TypeError(f"log_params: expected a mapping, a dataclass or a Config; "
                        f"got {type(params).__name__}")
    return {key(k): param_value(v) for k, v in plain.items()}


def metric_value(value: Any) -> Optional[float]:
    """A float for numbers, booleans, one-element tensors and numpy scalars; None otherwise."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, numbers.Real):  # bool included: True -> 1.0
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()  # raises for tensors and arrays of more than one element
        except (ValueError, RuntimeError):
            return None
        return float(value) if isinstance(value, numbers.Real) else None
    return None
