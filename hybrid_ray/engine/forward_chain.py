"""Instance-level forward wrappers: precision regions and activation checkpointing each replace
a module's `forward` with a callable holding the forward it wrapped as `.original`, so several
wrappers form a chain that either can leave in any order."""
from __future__ import annotations

from typing import Any

import torch.nn as nn


def unwrap_forward(module: nn.Module, wrapper: Any) -> None:
    """Take `wrapper` out of `module`'s chain of instance-level forwards (each link has
    `.original`); the class forward is used again when it was the last link."""
    holder, link = module, module.__dict__.get("forward")
    while link is not None and link is not wrapper:
        holder, link = link, getattr(link, "original", None)
    if link is None:
        return  # already gone
    original = wrapper.original
    is_class_forward = getattr(original, "__self__", None) is module and \
        getattr(original, "__func__", None) is type(module).forward
    if holder is module:
        del module.__dict__["forward"]
        if not is_class_forward:
            module.forward = original  # type: ignore[method-assign]
    else:
        holder.original = original
