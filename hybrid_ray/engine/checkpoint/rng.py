"""Each rank's random-number states (torch, CUDA, Python, numpy) as JSON: a checkpoint restores
them only where the saving and loading layouts match, so a resumed run draws what it would have."""
from __future__ import annotations

import random
import sys
from typing import Any, Dict, Optional

import torch


def rng_state() -> dict:
    state: Dict[str, Any] = {"torch": torch.get_rng_state().tolist()}
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def rng_problem(state: dict) -> Optional[str]:
    """What in a parsed RNG file set_rng_state could not restore, None if nothing."""
    try:
        torch_state = torch.tensor(state["torch"], dtype=torch.uint8)
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    if torch_state.shape != torch.get_rng_state().shape:
        return f"its torch state has {torch_state.numel()} bytes, not {torch.get_rng_state().numel()}"
    return None
