"""A generic, strict loader: JSON-like dicts in, frozen dataclasses out.

One walker (`load_dataclass`) reads every schema section from its type hints, so the rules
(unknown keys are errors, bool is never a number, errors name the key path) hold everywhere
without per-section code. What a type hint cannot say goes in field metadata via `checked()`
(ranges, choices, conversion hooks) or in a section's `validate(path)` method (cross-field rules).

Supported hints: bool, int, float, str, object (any JSON value), Literal[...], Optional[X] /
X | None, dict[str, X], tuple[X, ...], tuple[X, Y], and nested dataclasses.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
from typing import (Any, Callable, Literal, Mapping, Optional, Union, get_args, get_origin,
                    get_type_hints)

from hybrid_ray.config.bounds import check_int_size
from hybrid_ray.config.errors import (ConfigError, config_error, join_path, suggest,
                                      unknown_key_error)

_NONE_TYPE = type(None)
# A conversion hook: (raw value, key path, fields of the section loaded so far) -> stored value.
Converter = Callable[[Any, str, dict], Any]


def checked(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
            lt: Optional[float] = None, choices: Optional[tuple] = None,
            convert: Optional[Converter] = None,
            absent: Any = dataclasses.MISSING, null_is_default: bool = False,
            case_insensitive: bool = False) -> Any:
    """A dataclass field with declarative load-time rules.

    ge/gt/le/lt: numeric bounds. choices: allowed values of a plain int/str field. convert: replaces
    type-driven loading (used where the type depends on a sibling, e.g. scheduler params on the
    scheduler type); fields load in declaration order, so siblings declared earlier are visible.
    absent: the raw value a missing key reads as (for a required field that has a convert hook).
    null_is_default: JSON null means "the default" instead of being a type error.
    case_insensitive: a Literal[str] field matches ignoring case and stores the canonical spelling.
    """
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "convert": convert,
            "null_is_default": null_is_default or None,
            "case_insensitive": case_insensitive or None}
    meta = {k: v for k, v in meta.items() if v is not None}
    if absent is not dataclasses.MISSING:
        meta["absent"] = absent
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    return get_type_hints(cls)


def load_dataclass(cls: type, raw: Any, path: str) -> Any:
    """Build `cls` from a mapping, rejecting unknown keys, then run its `validate(path)` hook."""
    if not isinstance(raw, Mapping):
        raise config_error(path, "expected an object", raw, f"a {cls.__name__} section")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if not isinstance(key, str):
            raise config_error(path, "expected string keys", key)
        if key not in fields:
            raise unknown_key_error(path, key, fields)
    hints = _hints(cls)
    values: dict = {}
    for name, field in fields.items():
        fpath = join_path(path, name)
        if name in raw:
            values[name] = _load_field(field, hints[name], raw[name], fpath, values)
        elif "absent" in field.metadata:
            values[name] = _load_field(field, hints[name], field.metadata["absent"], fpath, values)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise config_error(fpath, "missing required key",
                               allowed=f"expected {describe(hints[name])}")
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def check_fields(obj: Any, path: str) -> None:
    """Check a section built in Python (not loaded from JSON) by the rules `load_dataclass`
    applies to each of its fields, then its `validate(path)` hook: a section's `__post_init__`
    calls this, so `ScalingConfig(min_workers=0)` fails like the same key in a file would."""
    hints, loaded = _hints(type(obj)), {}
    for field in dataclasses.fields(obj):
        if field.init:
            loaded[field.name] = _load_field(field, hints[field.name], getattr(obj, field.name),
                                             join_path(path, field.name), loaded)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)


def _load_field(field: dataclasses.Field, hint: Any, raw: Any, path: str, loaded: dict) -> Any:
    meta = field.metadata
    if raw is None and meta.get("null_is_default"):
        return field.default_factory() if field.default is dataclasses.MISSING else field.default
    if "convert" in meta:
        value = meta["convert"](raw, path, loaded)
    else:
        value = load_value(hint, raw, path, case_insensitive=meta.get("case_insensitive", False))
    check_range(value, path, ge=meta.get("ge"), gt=meta.get("gt"), le=meta.get("le"),
                lt=meta.get("lt"), choices=meta.get("choices"))
    return value


def check_range(value: Any, path: str, ge: Optional[float] = None, gt: Optional[float] = None,
                le: Optional[float] = None, lt: Optional[float] = None,
                choices: Optional[tuple] = None) -> None:
    """Raise `<path>: out of range; got v; allowed: ...` unless value fits; None always fits."""
    if value is None:
        return
    if choices is not None:
        if value not in choices:
            allowed = ", ".join(str(c) for c in choices)
            raise config_error(path, "out of range", value, f"allowed: {allowed}")
        return
    bounds = [(ge, ">=", value >= ge if ge is not None else True),
              (gt, ">", value > gt if gt is not None else True),
              (le, "<=", value <= le if le is not None else True),
              (lt, "<", value < lt if lt is not None else True)]
    if not all(ok for _, _, ok in bounds):
        allowed = " and ".join(f"{op} {b}" for b, op, _ in bounds if b is not None)
        raise config_error(path, "out of range", value, f"allowed: {allowed}")


def load_value(hint: Any, raw: Any, path: str, nullable: bool = False,
               case_insensitive: bool = False) -> Any:
    """Check and convert one JSON value against a type hint; the error names `path`."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not _NONE_TYPE]
        if len(inner) != 1 or len(inner) == len(args):
            raise TypeError(f"schema bug at {path}: only Optional[X] unions are supported")
        if raw is None:
            return None
        return load_value(inner[0], raw, path, nullable=True, case_insensitive=case_insensitive)
    if origin is Literal:
        return _load_literal(args, raw, path, case_insensitive)
    if origin is dict:
        return _load_dict(hint, args[1], raw, path, nullable)
    if origin is tuple:
        return _load_tuple(hint, args, raw, path, nullable)
    if dataclasses.is_dataclass(hint):
        if raw is None and not nullable:
            raise _type_error(hint, raw, path, nullable)
        return load_dataclass(hint, raw, path)
    return _load_scalar(hint, raw, path, nullable)


def _load_scalar(hint: Any, raw: Any, path: str, nullable: bool) -> Any:
    if hint is object or hint is Any:
        return raw
    if hint is bool:
        if isinstance(raw, bool):
            return raw
    elif hint is int:
        # bool is an int subclass in Python; a config `true` for a bucket size is a mistake.
        if isinstance(raw, int) and not isinstance(raw, bool):
            check_int_size(raw, path)  # a section built in Python skips check_bounds
            return raw
        if isinstance(raw, float) and raw.is_integer():  # JSON configs write 5e8 for sizes
            check_int_size(raw, path)  # 1e300 is integral too
            return int(raw)
    elif hint is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            if isinstance(raw, int):
                check_int_size(raw, path)  # float(10**400) is an OverflowError
            elif not math.isfinite(raw):
                raise config_error(path, "expected a finite number", raw)
            return float(raw)
    elif hint is str:
        if isinstance(raw, str):
            return raw
    else:
        raise TypeError(f"schema bug at {path}: unsupported type hint {hint!r}")
    raise _type_error(hint, raw, path, nullable)


def _load_literal(choices: tuple, raw: Any, path: str, case_insensitive: bool) -> Any:
    for choice in choices:
        # type() check: Literal[1] must not accept True, which compares equal to 1.
        if type(raw) is type(choice) and raw == choice:
            return choice
        if case_insensitive and isinstance(raw, str) and isinstance(choice, str) \
                and raw.lower() == choice.lower():
            return choice
    allowed = "allowed: " + ", ".join(repr(c) for c in choices)
    if isinstance(raw, str):
        allowed += suggest(raw, [c for c in choices if isinstance(c, str)])
    raise config_error(path, "invalid value", raw, allowed)


def _load_dict(hint: Any, value_hint: Any, raw: Any, path: str, nullable: bool) -> dict:
    if not isinstance(raw, Mapping):
        raise _type_error(hint, raw, path, nullable)
    out = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise config_error(path, "expected string keys", key)
        out[key] = load_value(value_hint, value, join_path(path, key))
    return out


def _load_tuple(hint: Any, args: tuple, raw: Any, path: str, nullable: bool) -> tuple:
    if not isinstance(raw, (list, tuple)):
        raise _type_error(hint, raw, path, nullable)
    if len(args) == 2 and args[1] is Ellipsis:
        item_hints = [args[0]] * len(raw)
    elif len(raw) != len(args):
        raise config_error(path, f"expected a list of {len(args)} items", raw)
    else:
        item_hints = list(args)
    return tuple(load_value(h, v, f"{path}[{i}]") for i, (h, v) in enumerate(zip(item_hints, raw)))


def describe(hint: Any) -> str:
    """Human words for a type hint, for 'expected ...' messages."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not _NONE_TYPE]
        return f"{describe(inner[0])} or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list"
        return f"a list of {len(args)} items"
    if origin is dict or dataclasses.is_dataclass(hint):
        return "an object"
    words = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return words.get(hint, "a JSON value")


def _type_error(hint: Any, raw: Any, path: str, nullable: bool) -> ConfigError:
    suffix = " or null" if nullable else ""
    return config_error(path, f"expected {describe(hint)}{suffix}", raw)


def to_plain(obj: Any) -> Any:
    """Dataclasses/tuples -> dicts/lists, recursively: the JSON-able form `load_dataclass` reads."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def flatten(plain: Mapping, prefix: str = "") -> dict:
    """Nested dict -> {'a.b.c': scalar}. Lists, empty dicts and dicts whose keys are not
    identifiers (regexes) become compact JSON strings: tracking backends such as MLflow only
    take scalar values and keys made of word characters, dots, dashes, slashes and spaces."""
    out: dict = {}
    for key, value in plain.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value and all(k.isidentifier() for k in value):
            out.update(flatten(value, name))
        elif isinstance(value, (Mapping, list)):
            out[name] = json.dumps(value, separators=(",", ":"))
        else:
            out[name] = value
    return out
