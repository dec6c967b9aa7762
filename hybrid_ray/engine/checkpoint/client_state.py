"""A save's `client_state`: JSON in meta.json when JSON holds it exactly, else `client_state.pt`.

What `torch.load(weights_only=True)` can load back is accepted: tensors, numbers, strings,
bytes, None, bools, lists, tuples, dicts (with keys of those kinds), numpy arrays and scalars of
non-object dtypes (numpy's RNG state, `np.random.get_state()`, is such a tuple). Anything else
(a custom object, a lambda, an object array) is refused at save time with a CheckpointError that
names its key, so a save never writes what a load would refuse. The file is read back with
weights_only=True and numpy's array and dtype constructors as the only extra allowed globals:
nothing arbitrary is unpickled. Checkpoints whose client_state is in meta.json read as before.
"""
from __future__ import annotations

import io
import math
from typing import Any, List, Optional, Tuple

import torch

from .storage import CheckpointError

FILE = "client_state.pt"
_JSON_LEAVES = (str, int, float, bool, type(None))


def _json_exact(value: Any) -> bool:
    """True when json.loads(json.dumps(value)) == value with the same types (no tuples, only
    str keys, finite floats), so meta.json can hold it as before."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_exact(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_exact(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, _JSON_LEAVES)


def _numpy_globals() -> List[Any]:
    """numpy's array, scalar and dtype constructors, for weights_only loading (empty without numpy)."""
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSUV"}
    return [_reconstruct, scalar, np.ndarray, np.dtype, *dtypes]


def _load(data: bytes) -> Any:
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _dump(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _is_array(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return type(value).__module__ == "numpy" and dtype is not None and not dtype.hasobject


def _problem(value: Any, path: str) -> Optional[str]:
    """The first key below `path` whose value cannot be loaded back, with why; None if none."""
    if isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, (str, int, float, bool, type(None))):
                return f"{path}: a key of type {type(key).__name__}"
            problem = _problem(item, f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    if isinstance(value, _JSON_LEAVES + (bytes, torch.Tensor)) or _is_array(value):
        return None
    try:  # anything else: ask torch's own weights-only loader about this value alone
        _load(_dump(value))
    except Exception as e:  # noqa: BLE001 - pickling and the weights-only unpickler raise many types
        return f"{path}: a {type(value).__module__}.{type(value).__qualname__} ({type(e).__name__})"
    return None


def prepare(client_state: Any) -> Tuple[dict, Optional[bytes]]:
    """(what meta.json holds, the bytes of client_state.pt or None). CheckpointError naming the
    offending key when something in it could not be loaded back with weights_only=True."""
    client_state = {} if client_state is None else client_state
    if not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    if _json_exact(client_state):
        return client_state, None
    problem = _problem(client_state, "client_state")
    if problem is None:
        try:
            data = _dump(client_state)
            _load(data)
            return {}, data
        except Exception as e:  # noqa: BLE001 - e.g. a value whose pickling fails only in the whole
            problem = f"client_state: {type(e).__name__}: {str(e)[:200]}"
    raise CheckpointError(f"{problem} cannot be saved: client_state must hold what "
                          "torch.load(weights_only=True) loads back (tensors, numbers, strings, bytes, "
                          "None, lists, tuples, dicts, numpy arrays and scalars)")


def parse(data: bytes, ckpt: str) -> dict:
    """A verified client_state.pt's dict; CheckpointError naming the file if it does not load."""
    try:
        value = _load(data)
    except Exception as e:  # noqa: BLE001 - the weights-only unpickler raises many types
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {FILE} does not load with "
                              f"weights_only=True ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {FILE} holds a {type(value).__name__}, "
                              "not a dict")
    return value
