"""Config errors and the one-line message format every config error uses.

Format: `<key path>: <problem>; got <value repr>; <what is allowed>`. The "got" and "allowed" parts
are left out where they say nothing (an unknown key has no value worth showing).
"""
from __future__ import annotations

import difflib
from typing import Iterable, Optional

_MAX_REPR = 80  # a whole nested section in one message would drown the key path
_NO_VALUE = object()  # sentinel: "no got part", since None is a value worth reporting


class ConfigError(ValueError):
    """A config that cannot be used as written. `path` is the dotted key path (may be empty)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple:
        # Ray ships exceptions from workers to the driver by pickling; keep `path` across that.
        return (type(self), (str(self), self.path))


class NotSupportedError(ConfigError):
    """A valid DeepSpeed setting that this engine does not implement yet."""


class Verbatim(str):
    """A 'got' value that is already prose ("both true", "32, 8, 2"): shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def short_repr(value: object) -> str:
    """repr() cut to one short line, so a message stays readable when the value is a big section."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's 4300-digit limit, a deep dict
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def config_error(path: str, problem: str, got: object = _NO_VALUE, allowed: Optional[str] = None,
                 cls: type = ConfigError) -> ConfigError:
    """Build (not raise) an error in the standard one-line format."""
    parts = [f"{path or '<config>'}: {problem}"]
    if got is not _NO_VALUE:
        parts.append(f"got {short_repr(got)}")
    if allowed:
        parts.append(allowed)
    return cls("; ".join(parts), path)


def join_path(path: str, key: object) -> str:
    """Extend a key path: identifiers with a dot, anything else (regex keys) as ['...']."""
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def unknown_key_error(path: str, key: str, allowed: Iterable[str]) -> ConfigError:
    """The error for a key the schema does not know, with the closest valid key if there is one."""
    allowed = list(allowed)
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {close[0]!r}?"
    else:
        hint = "allowed: " + (", ".join(allowed) if allowed else "(none)")
    return config_error(join_path(path, key), "unknown key", allowed=hint)


def suggest(value: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for a near-miss string value, else ''."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
