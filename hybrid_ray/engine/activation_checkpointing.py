"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

Two ways in, one mechanism (`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`):

    class M(nn.Module):                                   # a decorator on a method
        @checkpoint_activations(checkpoint_in_fp32=True)
        def forward_with_checkpoint(self, x):
            return self.block2(self.block1(x))

    block = checkpoint_activations(Block(cfg))            # a module: its forward, patched in place

and the config section `activation_checkpointing` with `enabled: true`, which makes the engine
patch the blocks of the model itself (`apply_activation_checkpointing`).

What is stored: only the checkpointed function's tensor arguments (the "boundary" tensors); every
tensor the function's ops save for backward is dropped and recomputed when backward reaches it.
The recompute replays the forward's CPU (and CUDA) RNG state, so dropout draws the same mask, and
torch re-enters the forward's autocast state, so a bf16/fp16 region recomputes in the same dtypes;
the engine's precision hooks on norms inside a block run again on recompute and do the same.

`checkpoint_in_fp32`: floating tensor arguments are cast to fp32 before the checkpointed call.
  Does: the boundary tensors kept for backward are fp32 (twice the bytes of bf16/fp16), and the
  function sees fp32 inputs, so ops autocast leaves alone (residual adds, elementwise ops) compute
  in fp32 and the function's output may come back fp32 where it would have been half.
  Does not: change the dtype autocast computes matmuls in, the precision of anything recomputed
  inside the function (never stored), or the precision of values already rounded upstream (a
  half-to-fp32 cast is exact). Without autocast and with fp32 inputs it is a no-op.
`cpu_checkpointing`: the boundary tensors are packed into host memory
  (`torch.autograd.graph.save_on_cpu`, pinned when CUDA is present) and copied back in backward.
  The recomputed activations live on the device for the length of one block's backward, as usual.

Every tensor argument, positional, keyword or inside lists/tuples/dicts, is a boundary tensor
(the arguments are flattened before the call); non-tensor arguments are passed through as they are.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from ..config.errors import NotSupportedError, config_error
from ..config.sections import ActivationCheckpointingConfig
from .forward_chain import unwrap_forward

log = logging.getLogger("hybrid_ray")

_MARK = "__hybrid_ray_checkpointed__"  # set on decorated functions: the engine skips their modules
_SECTION = "activation_checkpointing"
# Accepted for DeepSpeed compatibility; logged once per process when a config sets them.
_NO_EFFECT = {
    "contiguous_memory_optimization": "the caching allocator reuses the freed activation blocks",
    "synchronize_checkpoint_boundary": "no device sync is needed; use torch.profiler to time blocks",
    "profile": "use torch.profiler to time forward and recompute",
}
_logged: set = set()
# Containers whose forward is never called (the parent iterates them): patching them does nothing.
_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class CheckpointOptions:
    """How one checkpointed call stores its boundary tensors (see the module docstring)."""

    checkpoint_in_fp32: bool = False
    cpu_checkpointing: bool = False
    preserve_rng_state: bool = True


def _to_fp32(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != torch.float32:
        return leaf.float()
    return leaf


def _host_memory(enabled: bool) -> Any:
    """Context that packs saved tensors into host memory; a null context when not enabled."""
    if not enabled:
        return _NullContext()
    # Looked up at call time (not imported by name) so tests can observe what it packs.
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def checkpoint_call(fn: Callable[..., Any], args: tuple, kwargs: dict,
                    options: CheckpointOptions) -> Any:
    """fn(*args, **kwargs), storing only its tensor arguments and recomputing the rest in backward."""
    # Flattened so that every tensor argument, keyword or nested, is a top-level checkpoint
    # input: torch only packs those (so only those are offloaded and visible to saved-tensor
    # hooks), and kwargs named like checkpoint's own options (`debug`, ...) cannot collide.
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if options.checkpoint_in_fp32:
        leaves = [_to_fp32(leaf) for leaf in leaves]

    def run(*flat: Any) -> Any:
        a, kw = pytree.tree_unflatten(list(flat), spec)
        return fn(*a, **kw)

    if not torch.is_grad_enabled():  # eval/inference: nothing is saved, nothing to recompute
        return run(*leaves)
    with _host_memory(options.cpu_checkpointing):
        return checkpoint(run, *leaves, use_reentrant=False,
                          preserve_rng_state=options.preserve_rng_state)


class CheckpointedForward:
    """Stands in for a module's `forward` (an instance attribute): the original, checkpointed.

    A callable object rather than a closure, so `copy.deepcopy(model)` rebinds `original` to the
    copy (a closure would keep calling the original module's forward).
    """

    def __init__(self, original: Callable[..., Any], options: CheckpointOptions):
        self.original = original
        self.options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_call(self.original, args, kwargs, self.options)


def _patch_module(module: nn.Module, options: CheckpointOptions) -> Tuple[nn.Module, Any]:
    """Checkpoint `module`'s forward by setting an instance attribute: no new module, same keys."""
    wrapper = CheckpointedForward(module.forward, options)
    module.forward = wrapper  # type: ignore[method-assign]
    return module, wrapper


def is_checkpointed(module: nn.Module) -> bool:
    """True when the module's forward already checkpoints (patched, or a decorated method)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, CheckpointedForward) or getattr(type(module).forward, _MARK, False)


def remove_checkpointing(module: nn.Module) -> nn.Module:
    """Undo `checkpoint_activations(module)`: the forward it wrapped is used again."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, CheckpointedForward):
        unwrap_forward(module, forward)  # the forward it wrapped (class or instance-level) is back
    return module


def checkpoint_activations(target: Any = None, *, checkpoint_in_fp32: bool = False,
                           cpu_checkpointing: bool = False, preserve_rng_state: bool = True) -> Any:
    """Checkpoint a function, a method or a module (DeepSpeed's checkpoint_activations).

    `@checkpoint_activations` or `@checkpoint_activations(checkpoint_in_fp32=True)` on a function
    or method returns it checkpointed. `checkpoint_activations(module, ...)` patches the module's
    forward in place (its structure and state_dict keys do not change) and returns the module;
    `remove_checkpointing(module)` undoes it. Options: see the module docstring.
    """
    options = CheckpointOptions(checkpoint_in_fp32, cpu_checkpointing, preserve_rng_state)
    if target is None:
        return functools.partial(_checkpoint_target, options=options)
    return _checkpoint_target(target, options)


def _checkpoint_target(target: Any, options: CheckpointOptions) -> Any:
    if isinstance(target, nn.Module):
        remove_checkpointing(target)  # wrapping twice replaces the options, never nests
        _patch_module(target, options)
        return target
    if callable(target) and not isinstance(target, type):
        @functools.wraps(target)
        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            return checkpoint_call(target, args, kwargs, options)
        setattr(checkpointed, _MARK, True)
        return checkpointed
    raise TypeError("checkpoint_activations: expected a function, a method or an nn.Module; "
                    f"got {type(target).__name__} (for a module class, decorate its forward)")


# ---- the config section: the engine checkpoints the model's blocks ------------------------------

@dataclass
class CheckpointingPlan:
    """The modules the engine checkpoints (qualified names) and how to undo it."""

    names: List[str] = field(default_factory=list)
    _patches: List[Tuple[nn.Module, Any]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        for module, wrapper in self._patches:
            if module.__dict__.get("forward") is wrapper:  # else replaced since: not ours to undo
                remove_checkpointing(module)
        self._patches.clear()


def apply_activation_checkpointing(model: nn.Module,
                                   config: ActivationCheckpointingConfig) -> CheckpointingPlan:
    """Checkpoint the modules `config` selects; an empty plan when it is not enabled."""
    _check(config)
    if not config.enabled:
        _note_inert_settings(config)
        return CheckpointingPlan()
    _note_no_effect_settings(config)
    names = [n for n, _ in select_modules(model, config.module_pattern, config.number_checkpoints)]
    options = CheckpointOptions(cpu_checkpointing=config.cpu_checkpointing)
    modules = dict(model.named_modules())
    plan = CheckpointingPlan(names, [_patch_module(modules[n], options) for n in names])
    _log_rank0(f"activation checkpointing: {len(names)} module(s) recomputed in backward"
               f"{' (saved inputs in host memory)' if config.cpu_checkpointing else ''}: "
               + _abbreviate(names))
    return plan


def _check(config: ActivationCheckpointingConfig) -> None:
    # Also refused by load_config; repeated here for configs built as dataclasses directly.
    if config.partition_activations:
        raise config_error(f"{_SECTION}.partition_activations", "not supported yet", True,
                           "allowed: false (partitioning activations across ranks needs tensor "
                           "parallelism, which is planned)", cls=NotSupportedError)


def select_modules(model: nn.Module, pattern: Optional[str],
                   number: Optional[int]) -> List[Tuple[str, nn.Module]]:
    """The modules to checkpoint, in model order.

    Candidates: submodules whose qualified name fully matches `pattern`, or, without a pattern,
    every child of every nn.ModuleList (a transformer's blocks). Never candidates: the root, a
    ModuleList/ModuleDict (never called), a module inside another candidate (the outer recompute
    already covers it), a module that checkpoints itself already. With `number` = k < n candidates, k of them evenly spaced:
    candidate floor(i * n / k) for i in 0..k-1 (n=4, k=2: the 1st and 3rd; n=10, k=4: 0, 2, 5, 7).
    """
    found = _candidates(model, pattern)
    if not found:
        raise _nothing_matched(model, pattern)
    if number is None or number >= len(found):
        return found
    n = len(found)
    return [found[(i * n) // number] for i in range(number)]


def _candidates(model: nn.Module, pattern: Optional[str]) -> List[Tuple[str, nn.Module]]:
    if pattern is not None:
        regex = re.compile(pattern)
        matched = [(n, m) for n, m in model.named_modules() if n and regex.fullmatch(n)]
    else:
        matched = [(f"{n}.{c}" if n else c, child) for n, m in model.named_modules()
                   if isinstance(m, nn.ModuleList) for c, child in m.named_children()]
    out: List[Tuple[str, nn.Module]] = []
    for name, module in matched:
        if isinstance(module, _NEVER_CALLED) or is_checkpointed(module) or \
                any(name.startswith(o + ".") for o, _ in out):
            continue
        out.append((name, module))
    return out


def _nothing_matched(model: nn.Module, pattern: Optional[str]) -> Exception:
    names = [n for n, _ in model.named_modules() if n]
    example = f"the model's modules: {_abbreviate(names)}" if names else "the model has no submodules"
    if pattern is None:
        return config_error(f"{_SECTION}.module_pattern", "no module to checkpoint: the model has "
                            "no nn.ModuleList blocks (or they checkpoint themselves already)", None,
                            f"set a regex matching whole module names; {example}")
    return config_error(f"{_SECTION}.module_pattern", "matches no module", pattern,
                        f"a regex matching whole qualified module names; {example}")


def _abbreviate(names: List[str], keep: int = 6) -> str:
    shown = ", ".join(names[:keep])
    return shown + (f", ... ({len(names)} in all)" if len(names) > keep else "")


def _note_no_effect_settings(config: ActivationCheckpointingConfig) -> None:
    for key, why in _NO_EFFECT.items():
        if getattr(config, key):
            _log_once(f"{_SECTION}.{key}=True: accepted for DeepSpeed compatibility, no effect "
                      f"here ({why})")


def _note_inert_settings(config: ActivationCheckpointingConfig) -> None:
    # DeepSpeed reads these keys for its checkpoint() API without an `enabled` switch; here they
    # act only on the blocks the engine checkpoints, so say so rather than ignore them silently.
    set_keys = [k for k in ("module_pattern", "number_checkpoints", "cpu_checkpointing")
                if getattr(config, k) not in (None, False)]
    if set_keys:
        _log_once(f"{_SECTION}: {', '.join(set_keys)} set but enabled is false: no effect "
                  "(checkpoint_activations(...) in model code takes its own arguments)")


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        _log_rank0(msg)


def _log_rank0(msg: str) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        log.info(msg)
