"""1-bit Adam in the paper's form: each rank's *momentum* travels at one bit, not its gradient.

After the warm-up every rank holds the same averaged momentum M of the previous step (the
decoded result of the last exchange, kept as its wire bytes: one bit per element). Rank r
sends owner j its chunk of

    x_r = beta1 * M / W + (1 - beta1) * c_r * g_r   (+ its worker residual)

at one bit and one scale; the owner sums the decoded chunks (that sum is beta1 * M + (1 -
beta1) * sum_r c_r g_r, the next momentum, compressed), adds its server residual and sends its
chunk of the result back to everyone at one bit (one all_to_all, one all_gather). Every rank then
holds the same new M; the owner's optimizer *sets* its momentum to its slice of M (frozen.py,
momentum given) instead of folding a gradient into it. Compressing the momentum is what keeps
1-bit Adam level with dense Adam: the momentum changes slowly, so its signs mostly repeat and the
residuals stay small, where a gradient's signs are mostly noise (the quality study: level with
dense at 600 steps, where the gradient form lost 5-9%).

Clipping has to happen before the exchange, on each rank's own gradient (c_r, from its local
norm, as DeepSpeed's 1-bit Adam clips what each rank holds): the sum that arrives is a
momentum, whose norm says nothing about the step's gradient. So the exchange waits for the
whole backward (every bucket's gradient for the local norm) and runs at the first finish().

M is kept in the reducer's units (loss-scaled sums over ranks) and rescaled with the loss
scale. It is not checkpointed: when a rank has no M (the first compressed step, or after a
resume at any world size) the owners add beta1 times their optimizer's momentum slice instead,
which is the same quantity, exactly. Because every rank needs all of M, this form costs the
all_gather at stages 1-2 too, and it needs each rank's whole window gradient: at stage 2 the
reducer then lets autograd sum a window's micro-batches into .grad and sends the buckets at the
boundary (`needs_whole_window`), as stage 1 does, warm-up included, so gradient memory is
stage 1's. Stage 3 (parameters gathered and released during backward, collectives finished early to
bound memory) is not supported.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from .base import BucketKey, Layout, host_copies
from .onebit import OneBit, _bounds, decode_rows, owner_bounds, owner_sum, payload_bytes, row_width


class MomentumSource(Protocol):
    """What the optimizer side tells the exchange (zero/optimizer.py implements it)."""

    def beta1(self, key: BucketKey) -> float: ...

    def owned_momentum(self, key: BucketKey, begin: int, end: int) -> Optional[torch.Tensor]:
        """This rank's optimizer momentum of bucket elements [begin, end) (unscaled mean
        units, on any device), or None before the optimizer has state."""

    def step_scalars(self) -> Tuple[float, float]:
        """(the loss scale of the backward being reduced, gradient_clipping)."""


_Stashed = Tuple[BucketKey, torch.Tensor, int, int, Optional[dist.ProcessGroup]]


class OneBitMomentum(OneBit):
    """OneBit's warm-up, then the momentum exchange above (ZeRO stages 0-2)."""

    sends_momentum = True

    def __init__(self, warmup_steps: int, error_feedback: bool = True, update_bound: bool = True):
        super().__init__(warmup_steps, error_feedback, update_bound)
        self.source: Optional[MomentumSource] = None  # bound by the ZeroOptimizer
        self.shared: Dict[BucketKey, torch.Tensor] = {}  # M of the last applied step: wire rows
        self._next: Dict[BucketKey, torch.Tensor] = {}  # this step's, kept if the step applies
        self._stash: List[_Stashed] = []
        self._results: Dict[BucketKey, torch.Tensor] = {}
        self._group: Optional[dist.ProcessGroup] = None  # the exchanges' group (fold_debt's)

    # Each rank's momentum term is its whole window's gradient. Asked of the reducer in the
    # warm-up too: the same reduction order then (stage 2 equals stage 1 bit for bit), and
    # stage 1's gradient memory, which the compressed steps need anyway.
    needs_whole_window = True

    def on_step(self, overflow: bool, scale_ratio: float) -> None:
        super().on_step(overflow, scale_ratio)
        if not overflow:  # a skipped step left every optimizer's momentum as it was
            self.shared.update(self._next)
        self._next = {}
        if scale_ratio != 1.0:
            for rows in self.shared.values():
                rows.view(torch.float32)[:, 0].mul_(scale_ratio)  # each row's leading fp32 scale

    def state_dict(self) -> Dict[str, Any]:
        """OneBit's, plus the shared average: a recovery at the same size (a buddy's copy of
        this rank's state) then goes on bit for bit; without it, the owners reseed from their
        optimizer's momentum."""
        return {**super().state_dict(), "shared": host_copies(self.shared)}

    def load_state_dict(self, state: Dict[str, Any], device: torch.device) -> None:
        super().load_state_dict(state, device)
        self.shared = {k: v.to(device) for k, v in state.get("shared", {}).items()}
        self._next = {}

    def fold_debt(self) -> Callable[[], None]:
        """For a checkpoint: add to this rank's optimizer momentum what the error-feedback
        residuals still owe its chunks, so that the saved momentum carries it; returns the undo.

        The residuals (each rank's worker residual, each owner's server residual) are per rank
        and layout, and a checkpoint does not keep them; dropped, they take about half the
        momentum's norm with them (the tiny LM job: a resumed run's loss jumped and, on Ray,
        diverged). Folded in as debt / beta1, the first exchange after a resume, whose owners
        add beta1 times their momentum (no shared average yet), sums what the run that went on
        sums. Collective (one all_reduce per bucket): every rank calls it, as it saves."""
        undo: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if self._group is None or not self.residuals or self.source is None:
            return lambda: None
        loss_scale, _ = self.source.step_scalars()
        world, me = dist.get_world_size(self._group), dist.get_rank(self._group)
        for key in sorted(self.residuals):  # the same keys, in the same order, on every rank
            debt = self.residuals[key].clone()
            dist.all_reduce(debt, group=self._group)
            a, b = _bounds(debt.numel(), world)[me]
            owed = debt[a:b]
            if key in self.server:
                owed = owed + self.server[key]
            view = self.source.owned_momentum(key, a, b)
            if view is None:
                continue
            undo.append((view, view.clone()))
            view.add_(owed.to(view.device), alpha=1.0 / (self.source.beta1(key) * loss_scale * world))

        def restore() -> None:
            for view, kept in undo:
                view.copy_(kept)
        return restore

    def exchange(self, key: BucketKey, grad: torch.Tensor, lo: int, hi: int,
                 group: Optional[dist.ProcessGroup], layout: Optional[Layout] = None
                 ) -> Tuple[int, Callable[[], torch.Tensor]]:
        if self.step < self.warmup_steps:
            return super().exchange(key, grad, lo, hi, group, layout)
        if self.source is None:
            raise RuntimeError("onebit momentum form: no optimizer bound to the exchange")
        bounds = owner_bounds(grad.numel(), lo, hi, group)
        self._group = group
        with self.timer.span("compress"):
            self._stash.append((key, grad.to(torch.float32, copy=True), lo, hi, group))
        # Bytes handed to collectives, as the dense reduction counts its input: the chunks for
        # the owners, then this rank's served row.
        sent = sum(payload_bytes(b - a) for a, b in bounds) + row_width(bounds)

        def finish() -> torch.Tensor:
            if key not in self._results:
                self._exchange_stashed()
            return self._results.pop(key)
        return sent, finish

    def _exchange_stashed(self) -> None:
        """Every stashed bucket of this backward: clip by the local norm, both levels, decode."""
        stash, self._stash = self._stash, []
        loss_scale, clip = self.source.step_scalars()
        coef = 1.0
        if clip > 0 and stash:
            with self.timer.span("compress"):
                local = math.sqrt(sum(float(acc.double().square().sum()) for _, acc, *_ in stash)) / loss_scale
            coef = min(1.0, clip / (local + 1e-6)) if math.isfinite(local) else 1.0  # inf stays inf: overflow
        # Every bucket's worker level is in flight before the first owner waits on its own.
        workers = [self._send_chunks(key, acc, group, coef) for key, acc, _, _, group in stash]
        served = [self._serve_chunk(key, acc.numel(), group, sent, loss_scale)
                  for (key, acc, _, _, group), sent in zip(stash, workers)]
        for (key, acc, lo, hi, group), (rows, work) in zip(stash, served):
            self.timer.wait(work)
            self._next[key] = rows
            bounds = _bounds(acc.numel(), dist.get_world_size(group))
            with self.timer.span("compress"):
                self._results[key] = decode_rows(rows, bounds, lo, hi)

    def _send_chunks(self, key: BucketKey, acc: torch.Tensor, group, coef: float):
        """Worker level: x_r's chunk for every owner at one bit, in one all_to_all."""
        world = dist.get_world_size(group)
        bounds = _bounds(acc.numel(), world)
        beta1 = self.source.beta1(key)
        with self.timer.span("compress"):
            x = acc.mul_((1 - beta1) * coef)
            prev = self.shared.get(key)
            if prev is not None:
                x.add_(decode_rows(prev, bounds), alpha=beta1 / world)
            residual = self.residuals.pop(key, None)
            if residual is not None:
                x.add_(residual)
        return self._to_owners(key, x, bounds, group)

    def _serve_chunk(self, key: BucketKey, numel: int, group, worker, loss_scale: float):
        """Server level: this rank's chunk of the new momentum, sent to all at one bit."""
        recv, _send, work = worker  # the send buffer is held until the collective is done
        self.timer.wait(work)
        world, me = dist.get_world_size(group), dist.get_rank(group)
        bounds = _bounds(numel, world)
        a, b = bounds[me]
        with self.timer.span("compress"):
            total = owner_sum(recv, bounds, me)
            if key not in self.shared:  # no M here: the owner adds beta1 * its own momentum
                owned = self.source.owned_momentum(key, a, b)
                if owned is not None:
                    beta1 = self.source.beta1(key)
                    total.add_(owned.to(total.device, torch.float32), alpha=beta1 * loss_scale * world)
        return self._broadcast(key, total, bounds, group)
