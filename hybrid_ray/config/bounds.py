"""Limits on the shape of config input before the schema reads it: nesting depth and integer size.

A config is a few levels deep and its integers fit in 64 bits; anything beyond that is garbage or
an accident, and without a limit it fails far from the loader: Python refuses to parse or print
integers of more than 4300 digits (ValueError), and printing or walking a structure nested
thousands deep overflows the stack (RecursionError). Both the JSON file path and dicts passed
directly go through `check_bounds`, so every input meets the same limits and the error names the
key path where the limit is passed.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from hybrid_ray.config.errors import ConfigError, Verbatim, config_error, join_path

MAX_DEPTH = 32  # objects and lists; the deepest real config (a job file) has 4
INT_LIMIT = 2**63  # |value| < INT_LIMIT: what a torch int64 holds
_JSON_DIGITS = 30  # longer integer literals are kept as text until check_bounds names their key
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (skipped) and brackets


class HugeInt:
    """An integer literal from a JSON file too long to convert safely, kept as its digit count.

    Not an int or a str, so a value that somehow skipped check_bounds still fails every type check.
    """

    __slots__ = ("digits",)

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def parse_int(text: str) -> Any:
    """json's parse_int hook: a normal int, or HugeInt so check_bounds can name the key."""
    return HugeInt(text) if len(text) > _JSON_DIGITS else int(text)


def check_bounds(raw: Any, path: str = "", depth: int = 1) -> None:
    """Raise ConfigError at the first value nested deeper than MAX_DEPTH or integer too large.

    The walk itself is bounded by MAX_DEPTH, so a self-referencing dict fails as too deep.
    """
    if isinstance(raw, (Mapping, list, tuple)):
        if depth > MAX_DEPTH:
            raise config_error(path, "nested too deeply",
                               allowed=f"allowed: at most {MAX_DEPTH} levels of objects and lists")
        items = raw.items() if isinstance(raw, Mapping) else enumerate(raw)
        for key, value in items:
            sub = join_path(path, key) if isinstance(raw, Mapping) else f"{path}[{key}]"
            check_bounds(value, sub, depth + 1)
    elif isinstance(raw, HugeInt):
        raise _too_large(path, f"an integer of {raw.digits} digits")
    elif isinstance(raw, int) and not isinstance(raw, bool):
        check_int_size(raw, path)  # floats are checked where an int field converts one


def check_int_size(value: float, path: str) -> None:
    """Raise ConfigError naming `path` for an integer (or an integral float: 1e300) of magnitude
    2**63 or more; other values pass."""
    if isinstance(value, float) and not value.is_integer():
        return  # also nan and inf: the schema's type checks report those
    if not -INT_LIMIT < value < INT_LIMIT:
        # bit_length, not repr: repr of a huge int is itself the ValueError being avoided.
        got = f"{value!r}" if isinstance(value, float) else f"an integer of {value.bit_length()} bits"
        raise _too_large(path, got)


def _too_large(path: str, got: str) -> ConfigError:
    return config_error(path, "out of range", Verbatim(got), "allowed: integers of magnitude < 2**63")


def too_deep_position(text: str) -> tuple[int, int]:
    """(line, column) of the first bracket that opens level MAX_DEPTH + 1 of a JSON text, for a
    file too deep for json itself to parse; (0, 0) if there is none."""
    depth = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                line = text.count("\n", 0, match.start()) + 1
                return line, match.start() - text.rfind("\n", 0, match.start())
        elif token in "]}":
            depth -= 1
    return 0, 0
