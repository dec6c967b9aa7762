"""The offloaded share of the optimizer step, bucket by bucket while backward runs
(`offload_optimizer.overlap_step`).

Without it the CPU step starts once backward has ended, and the device waits for all of it.
With it, each host gradient bucket is stepped in a background thread as soon as its copy has
landed: its sum of squares is taken (for the global norm and the overflow check), it is scaled
by the step's coefficient, the optimizer's own kernel (torch's Adam or AdamW, fused on the CPU)
updates the bucket's slices of the master and of the two moments, and the slice is cast for
the upload; on a GPU (pinned memory, stages 1-2) the slice is copied into the device's
parameters right away on a side stream: that bucket's layers are done with backward (a bucket
lands once all its gradients are final), and the next forward waits for the stream. At the
boundary only the buckets of the first layers, the last of backward, are left. The kernel is
elementwise and every bucket gets the coefficient the plain step would use, so the update is
the one without overlap (tests compare bitwise).

That coefficient must be known before the global norm: the unscaling is (loss scale x ranks),
clipping is not. With gradient_clipping the step runs after backward as without overlap (two
phases: the norm, then the step), unless `clip_with_previous_norm`, which clips by the previous
step's global norm instead: an approximation the user opts into. A new optimizer's first step
runs after backward as well (it creates the optimizer's state), and with that option so does
the first step after a build or a resume (no previous norm yet).

A bucket whose gradient is not finite is not stepped, nor any bucket after it. When the agreed
norm is not finite (on any rank), the buckets already stepped are rolled back by inverting the
update with the gradient that made it (exact up to rounding), and the step is skipped as
without overlap (fp16's loss scaler backs off; bf16 counts a skipped step).
"""
from __future__ import annotations

import inspect
import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch.optim.adam import adam as _adam

from .norms import square_sum

log = logging.getLogger("hybrid_ray")

# torch folded AdamW into Adam's functional form (decoupled_weight_decay); older releases keep
# a functional adamw of their own.
if "decoupled_weight_decay" in inspect.signature(_adam).parameters:
    def _kernel(decoupled: bool) -> Callable[..., None]:
        return lambda *a, **kw: _adam(*a, decoupled_weight_decay=decoupled, **kw)
else:  # pragma: no cover - torch releases before the merge
    from torch.optim.adamw import adamw as _adamw

    def _kernel(decoupled: bool) -> Callable[..., None]:
        return _adamw if decoupled else _adam


def land_in_place(work: Optional[dist.Work], result: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """A CPU engine's reduced bucket into its host slice (in the host step's thread; a GPU
    engine's bucket lands through HostOffload.land)."""
    if work is not None:
        work.wait()
    if result is not out:
        out.add_(result) if accumulate else out.copy_(result)


@dataclass
class _Space:
    """One host space's tensors and hyperparameters for the step in progress."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # the optimizer's state["step"]: moves once, when the step commits
    hyper: Dict[str, Any]  # a snapshot of the master's param group
    decoupled: bool  # AdamW's weight decay (else Adam's L2 term)
    staged: Optional[torch.Tensor]  # the upload's source, cast here (None: the master itself)
    # Where each bucket (by its offset in the shard) goes in the device's flat parameters, when
    # it is uploaded as soon as it has stepped (pinned, stages 1-2); None: write_back uploads.
    device_slices: Optional[Dict[int, Tuple[int, int]]] = None
    flat: Optional[torch.Tensor] = None


@dataclass
class _Bucket:
    space: int
    off: int
    grad: torch.Tensor  # the host gradient slice, scaled by the coefficient once stepped
    squares: float  # of the gradient before scaling
    stepped: bool


class BackwardStep:
    """Steps a ZeroOptimizer's host spaces bucket by bucket during the boundary backward."""

    def __init__(self, zero: Any, previous_norm: bool):
        self.zero = zero  # the ZeroOptimizer: masters, optimizer, offload, step scalars
        self.previous_norm = previous_norm
        self.last_norm: Optional[float] = None  # the last applied step's global norm
        self.overlapped = 0  # steps that ran during backward (tests and the benchmark read it)
        self.rolled_back = 0  # buckets undone after a non-finite norm
        self.coef = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid_ray-backward-step")
        self._spaces: Optional[Dict[int, _Space]] = None  # set while a backward is armed
        self._jobs: List[Future] = []
        self._poisoned = False
        self._uploads_waited = False
        self._said: set = set()
        offload = zero.offload
        self._stream = torch.cuda.Stream(offload.device) if offload.transfers and offload.pin else None
        self._uploaded: Set[Tuple[int, int]] = set()  # (space, shard offset) already on the device

    @property
    def armed(self) -> bool:
        return self._spaces is not None

    def arm(self) -> bool:
        """At the start of a boundary backward: whether its host buckets step as they land."""
        if self.armed:  # a backward cut short (an error) left steps behind: undo them first
            self.rollback()
        coef = self._coefficient()
        spaces = self._host_spaces() if coef is not None else None
        if spaces is None:
            return False
        self.coef, self._spaces, self._jobs = coef, spaces, []
        self._poisoned = self._uploads_waited = False
        return True

    def submit(self, index: int, off: int, grad: torch.Tensor, land: Callable[[], None]) -> Callable[[], Any]:
        """Queue host space `index`'s bucket at `off` (its gradient slice `grad`, complete once
        `land` returns); the returned callable waits for its step and re-raises its error."""
        job = self._pool.submit(self._run, index, off, grad, land)
        self._jobs.append(job)
        return job.result

    def settle(self) -> float:
        """Wait for every bucket; the sum of squares of this rank's host gradients (unscaled)."""
        done: List[_Bucket] = [j.result() for j in self._jobs]
        covered: Dict[int, int] = {}
        for b in done:
            covered[b.space] = covered.get(b.space, 0) + b.grad.numel()
        for i, s in self._spaces.items():
            if covered.get(i, 0) != s.master.numel():
                raise RuntimeError(f"overlap_step: host space {i} got {covered.get(i, 0)} of "
                                   f"{s.master.numel()} gradient elements in its boundary backward")
        return sum(b.squares for b in done)

    def commit(self, grad_norm: float) -> Tuple[Dict[int, torch.Tensor], Set[Tuple[int, int]]]:
        """The step holds: count it in the optimizer's state. Returns, by space, the source its
        upload copies from where it was cast here, and the (space, shard offset) of the buckets
        already uploaded (the device's stream now waits for those copies)."""
        for s in self._spaces.values():
            s.step.add_(1)  # as torch's kernel counts its own state steps
        staged = {i: s.staged for i, s in self._spaces.items() if s.staged is not None}
        uploaded, self._uploaded = self._uploaded, set()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        self.last_norm = grad_norm
        self.overlapped += 1
        self._disarm()
        return staged, uploaded

    def rollback(self) -> bool:
        """The step is skipped: undo every bucket already stepped, last first. True when some
        had been uploaded: the device's parameters must be written back."""
        if not self.armed:
            return False
        done = [j.result() for j in self._jobs if j.exception() is None]  # one that raised: left as is
        uploaded, self._uploaded = bool(self._uploaded), set()
        if self._stream is not None:
            self._stream.synchronize()  # no upload may still read what the inverse rewrites
        for b in reversed(done):
            if b.stepped:
                self._undo(self._spaces[b.space], b.off, b.grad)
                self.rolled_back += 1
        self._disarm()
        return uploaded

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- deciding ------------------------------------------------------------------------
    def _coefficient(self) -> Optional[float]:
        """What unscales (and clips) this step's gradients, or None when it cannot be known
        before the norm (or something else keeps the step after backward)."""
        why = self._obstacle()
        loss_scale, clip = self.zero.step_scalars()
        if not why and clip > 0 and not self.previous_norm:
            why = "gradient_clipping needs this step's norm (clip_with_previous_norm: true clips by the last one)"
        if why:
            if why not in self._said:
                self._said.add(why)
                log.warning("offload_optimizer.overlap_step: the CPU step runs after backward: %s", why)
            return None
        coef = 1.0 / self.zero.grad_divisor(loss_scale)
        if clip > 0:
            if self.last_norm is None:
                return None
            if self.last_norm > clip:
                coef *= clip / (self.last_norm + 1e-6)
        return coef

    def _obstacle(self) -> str:
        opt = self.zero.optimizer
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
            return f"the optimizer is {type(opt).__name__}, not torch's Adam or AdamW"
        for g in opt.param_groups:
            flags = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if g.get(k)]
            if flags:
                return f"{', '.join(flags)} set"
        if self.zero.reducer.compressor is not None:
            return "gradient compression"
        if self.zero.norm_excluded:
            return "a weight tied across pipeline stages"
        return ""

    def _host_spaces(self) -> Optional[Dict[int, _Space]]:
        opt, offload = self.zero.optimizer, self.zero.offload
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        out: Dict[int, _Space] = {}
        for i, (space, master) in enumerate(zip(self.zero.spaces, self.zero.masters)):
            if not space.offloaded:
                continue
            state = opt.state.get(master, {})
            if "exp_avg" not in state:  # the first step creates the state
                return None
            group = group_of[id(master)]
            decoupled = isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
            staged = None
            if offload.pin and space.dtype != torch.float32:
                staged = offload.staging(i, master.numel(), space.dtype)
            out[i] = _Space(master.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                            {k: v for k, v in group.items() if k != "params"}, decoupled, staged)
            if self._stream is not None and space.local_shard is None:  # stage 3: write_back
                out[i].device_slices = {off: (lo, hi) for _, lo, hi, off in space.shard_slices()}
                out[i].flat = space.flat
        return out

    # ---- in the thread -------------------------------------------------------------------
    def _run(self, index: int, off: int, grad: torch.Tensor, land: Callable[[], None]) -> _Bucket:
        land()
        if not self._uploads_waited:  # the last upload may still read a master or its cast
            self.zero.offload.wait_uploads()
            self._uploads_waited = True
        squares = square_sum([grad]).item() if grad.numel() else 0.0
        ok = math.isfinite(squares) and not self._poisoned
        if ok:
            self._step(self._spaces[index], off, grad)
            self._upload(index, off, grad.numel())
        else:
            self._poisoned = True
        return _Bucket(index, off, grad, squares, ok)

    def _step(self, s: _Space, off: int, grad: torch.Tensor) -> None:
        """The plain step's update on one slice: the same scaling, the same kernel."""
        part = slice(off, off + grad.numel())
        h = s.hyper
        grad.mul_(self.coef)
        with torch.no_grad():
            _kernel(s.decoupled)([s.master[part]], [grad], [s.exp_avg[part]], [s.exp_avg_sq[part]], [],
                                 [s.step.clone()], foreach=h.get("foreach"), fused=h.get("fused"),
                                 amsgrad=False, beta1=h["betas"][0], beta2=h["betas"][1], lr=h["lr"],
                                 weight_decay=h["weight_decay"], eps=h["eps"], maximize=False)
            if s.staged is not None:
                s.staged[part].copy_(s.master[part])

    def _upload(self, index: int, off: int, n: int) -> None:
        """The stepped bucket into the device's parameters now, on a side stream: its layers'
        backward is over (a bucket lands once all its gradients are final), so nothing reads
        these parameters again before the next forward, which waits for the stream."""
        s = self._spaces[index]
        if s.device_slices is None:
            return
        lo, hi = s.device_slices[off]
        src = (s.staged if s.staged is not None else s.master)[off:off + n]
        with torch.no_grad(), torch.cuda.stream(self._stream):
            s.flat[lo:hi].copy_(src, non_blocking=True)
        self._uploaded.add((index, off))

    @staticmethod
    def _undo(s: _Space, off: int, grad: torch.Tensor) -> None:
        """Invert one slice's Adam(W) update, given the (scaled) gradient it used."""
        part = slice(off, off + grad.numel())
        p, m, v, h = s.master[part], s.exp_avg[part], s.exp_avg_sq[part], s.hyper
        t = float(s.step) + 1
        lr, (b1, b2), eps, wd = float(h["lr"]), h["betas"], h["eps"], h["weight_decay"]
        with torch.no_grad():
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
            p.addcdiv_(m, denom, value=lr / (1 - b1 ** t))  # the moment's step, taken back
            if wd and s.decoupled:
                p.div_(1 - lr * wd)
            elif wd:  # Adam's L2 term was part of the gradient the moments saw
                grad = grad.add(p, alpha=wd)
            m.sub_(grad, alpha=1 - b1).div_(b1)
            v.addcmul_(grad, grad, value=-(1 - b2)).div_(b2).clamp_(min=0)
            if s.staged is not None:
                s.staged[part].copy_(p)

    def _disarm(self) -> None:
        self._spaces, self._jobs = None, []
