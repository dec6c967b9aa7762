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

In onebit's momentum form (compression/onebit_momentum.py) the exchange delivers the averaged
momentum itself: `momentum_given` sets exp_avg to it instead of folding a gradient in, and
`OptimizerMomentum` tells that exchange beta1 and this rank's momentum by bucket.

`bound`: a variance estimated once goes stale. An element whose gradients were small when it
froze and grew later divides a large momentum by a small root: on the quality job's LM, frozen
after 60 steps, single elements of the embeddings and attention weights moved 30-80x as far as
Adam ever moved them in a step (Adam's own ratio |m|/sqrt(v) stays near 1, because its v takes
in each new g*g), and the run fell behind dense. Since E[g^2] >= E[g]^2 and the momentum
estimates E[g], the step reads each element's variance as at least its bias-corrected momentum
squared: max(sqrt(v_hat), |m_hat|) in the denominator, so no element moves more than lr, and
elements whose frozen variance still fits their gradients step exactly as before.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from hybrid_ray.config.errors import NotSupportedError

FREEZABLE = (torch.optim.Adam, torch.optim.AdamW)


class FrozenStep(NamedTuple):
    """How a step after the 1-bit warm-up runs (step_frozen_variance's arguments)."""

    momentum_given: bool  # the exchange delivered the averaged momentum, not a gradient
    bound: bool  # the variance read as at least the momentum's square


def check_freezable(optimizer: torch.optim.Optimizer, momentum: bool = False) -> None:
    """A one-line NotSupportedError unless `optimizer` is an Adam or AdamW without amsgrad (and,
    for the momentum form, without L2 weight decay, which would enter the gradient)."""
    if not isinstance(optimizer, FREEZABLE):
        raise NotSupportedError(f"gradient_compression.type 'onebit' needs an Adam or AdamW optimizer "
                                f"(it freezes Adam's variance), got {type(optimizer).__name__}")
    if any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups):
        raise NotSupportedError("gradient_compression.type 'onebit' does not support amsgrad or maximize")
    if momentum and not _decoupled(optimizer) and any(g.get("weight_decay") for g in optimizer.param_groups):
        raise NotSupportedError("gradient_compression.form 'momentum' does not support Adam's weight_decay "
                                "(L2): use AdamW, or form 'gradient'")


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay") for g in optimizer.param_groups)


@torch.no_grad()
def step_frozen_variance(optimizer: torch.optim.Optimizer, momentum_given: bool = False,
                         bound: bool = False) -> None:
    """One step of `optimizer` (Adam/AdamW) over the parameters that have a .grad, leaving each
    parameter's exp_avg_sq as it is. Every such parameter must have stepped before (state).
    momentum_given: .grad is the new momentum (exp_avg is set to it), not a gradient.
    bound: the variance read as at least the momentum's square (no element moves more than lr)."""
    decoupled = _decoupled(optimizer)
    for group in optimizer.param_groups:
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_device.setdefault(p.device, []).append(p)
        for params in by_device.values():
            _step(optimizer, group, params, decoupled, momentum_given, bound)


def _step(optimizer: torch.optim.Optimizer, group: dict, params: List[torch.Tensor], decoupled: bool,
          momentum_given: bool, bound: bool) -> None:
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
    if momentum_given:
        torch._foreach_copy_(exp_avgs, grads)
    else:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    for m, v in zip(exp_avgs, exp_avg_sqs):
        m.masked_fill_(v == 0, 0.0)  # never saw a gradient in the warm-up: no 1-bit update
    t = float(steps[0])  # the same for every parameter of a group stepped together
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** t))
    if bound:
        floor = torch._foreach_abs(exp_avgs)
        torch._foreach_div_(floor, 1 - beta1 ** t)
        torch._foreach_maximum_(denom, floor)
        del floor
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / (1 - beta1 ** t))


class OptimizerMomentum:
    """The optimizer side of onebit's momentum exchange (its MomentumSource): beta1 and this
    rank's momentum of a bucket's elements, found through the reducer's shard offsets."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: List[torch.Tensor], reducer,
                 step_scalars: Callable[[], Tuple[float, float]]):
        self.optimizer, self.masters, self.reducer = optimizer, masters, reducer
        self.step_scalars = step_scalars
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def beta1(self, key: Tuple[int, int]) -> float:
        return float(self._group[id(self.masters[key[0]])]["betas"][0])

    def owned_momentum(self, key: Tuple[int, int], begin: int, end: int) -> Optional[torch.Tensor]:
        space, bucket = key
        grads = self.reducer.grads[space]
        b = grads.space.buckets[bucket]
        lo, _ = b.shard_range(grads.space.rank, grads.space.num_shards)
        exp_avg = self.optimizer.state.get(self.masters[space], {}).get("exp_avg")
        if exp_avg is None:
            return None
        start = grads.shard_offset[bucket] + b.start + begin - lo
        return exp_avg[start:start + end - begin]
