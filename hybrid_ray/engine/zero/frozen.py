"""Adam and AdamW with the variance frozen: the update 1-bit compression needs (compression/onebit.py).

Once gradients travel as sign bits, the second moment would learn the compression's scale,
not the gradient's: every entry of a chunk arrives with the same magnitude. 1-bit Adam keeps
the variance estimated during the dense warm-up and updates only the momentum. This step is
torch's Adam/AdamW step (same state, same bias corrections, same decoupled or L2 weight decay)
with `exp_avg_sq` read but never written, so the optimizer's state dict, checkpoints and a
later unfrozen step keep working unchanged.

An element whose variance is exactly zero saw no gradient during the whole warm-up (an embedding
row of a token not yet seen, a padding row). A 1-bit exchange sends it +-scale like every other
element, and divided by sqrt(0) + eps that is an update of ~1e8 times the learning rate: the run
diverges (seen on the LM job). Such elements keep a zero momentum and no update once frozen, as
DeepSpeed's `exp_avg_mask` does for rows its user names; weight decay still applies.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from hybrid_ray.config.errors import NotSupportedError

FREEZABLE = (torch.optim.Adam, torch.optim.AdamW)


def check_freezable(optimizer: torch.optim.Optimizer) -> None:
    """A one-line NotSupportedError unless `optimizer` is an Adam or AdamW without amsgrad."""
    if not isinstance(optimizer, FREEZABLE):
        raise NotSupportedError(f"gradient_compression.type 'onebit' needs an Adam or AdamW optimizer "
                                f"(it freezes Adam's variance), got {type(optimizer).__name__}")
    if any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups):
        raise NotSupportedError("gradient_compression.type 'onebit' does not support amsgrad or maximize")


@torch.no_grad()
def step_frozen_variance(optimizer: torch.optim.Optimizer) -> None:
    """One step of `optimizer` (Adam/AdamW) over the parameters that have a .grad, leaving each
    parameter's exp_avg_sq as it is. Every such parameter must have stepped before (state)."""
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay") for g in optimizer.param_groups)
    for group in optimizer.param_groups:
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_device.setdefault(p.device, []).append(p)
        for params in by_device.values():
            _step(optimizer, group, params, decoupled)


def _step(optimizer: torch.optim.Optimizer, group: dict, params: List[torch.Tensor], decoupled: bool) -> None:
    states = [optimizer.state[p] for p in params]
    if any("exp_avg_sq" not in s for s in states):
        raise RuntimeError("a frozen-variance step needs the variance of earlier dense steps "
                           "(gradient_compression.warmup_steps >= 1)")
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
    grads = [p.grad for p in params]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    if wd:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    for m, v in zip(exp_avgs, exp_avg_sqs):
        m.masked_fill_(v == 0, 0.0)  # never saw a gradient in the warm-up: no 1-bit update
    t = float(steps[0])  # the same for every parameter of a group stepped together
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** t))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / (1 - beta1 ** t))
