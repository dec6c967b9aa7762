"""The sharded optimizer: fp32 master shards, one fused step, parameters gathered back.

Composition, as in nanotron: a plain torch optimizer over fp32 master tensors (one per flat
space: this rank's shard), fed by the GradReducer, wrapped by this class which adds the global
gradient norm, overflow agreement, clipping and the all-gather of updated parameters.

Memory per parameter with Adam and half-precision parameters, between steps (ZeRO paper's
formulas): stage 0 16 bytes; stage 1 4 + 12/N (half params and half gradients whole, fp32 master
and two moments sharded); stage 2 2 + 12/N. The fp32 gradient shard (4/N) exists only from the
first reduction of a window to the end of its step, so stage 2 peaks at 2 + 16/N during backward,
against the paper's 2 + 14/N held all the time. `memory_breakdown()` reports the live figures.

With optimizer offload (the reducer's `offload`, see offload.py) the masters, master gradients
and optimizer state are host tensors and the step runs on the CPU; the device keeps 2 bytes per
parameter (+2 for stage 1's whole gradients). Everything here works on both placements: the
host-specific parts are the offload's `upload` in `copy_into` and the delayed update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .backward_step import BackwardStep
from .flat import FlatSpace
from .frozen import FrozenStep, OptimizerMomentum, check_freezable
from .norms import square_sum as _square_sum
from .offload import frozen_hyperparameters
from .overlap import ParamGatherOverlap
from .reducer import GradReducer
from .update import step_masters
from ..topology import Topology


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer boundary did."""

    applied: bool  # with delayed_param_update: launched; it reaches the parameters one step later
    overflow: bool
    grad_norm: float  # true (unscaled) global norm before clipping; inf/nan on overflow


@dataclass(frozen=True)
class Update:
    """A decided update not applied yet (ZeroOptimizer.prepare)."""

    grads: List[torch.Tensor]  # the reduced master gradients, per space, still scaled
    coef: float  # what unscales and clips them
    optimizer: torch.optim.Optimizer  # a view with the step's hyperparameters frozen
    frozen: Optional[FrozenStep] = None  # 1-bit: Adam's variance frozen (and how the step runs)


class ZeroOptimizer:
    """Owns the fp32 master shards and turns reduced gradients into updated parameters."""

    def __init__(self, spaces: List[FlatSpace], reducer: GradReducer, topo: Topology):
        self.spaces, self.reducer, self.topo = spaces, reducer, topo
        self.offload = reducer.offload  # one decision, shared with the reducer
        self.masters: List[torch.nn.Parameter] = []
        for space in spaces:
            # A space built from zero.Init partitions has no flat buffer, only its local shard.
            local = space.local_shard if space.local_shard is not None else space.gather_shard(space.flat)
            if self.offload is not None and space.offloaded:  # straight to the host, fp32 there
                shard = self.offload.to_host(local, torch.float32)
            else:
                shard = local.to(torch.float32, copy=local is space.local_shard)
            self.masters.append(torch.nn.Parameter(shard))
        self.optimizer: Optional[torch.optim.Optimizer] = None
        # Parameters (by id) whose gradient another rank of topo.model_group counts in the norm
        # (a weight tied across pipeline stages): left out here so that it counts once.
        self.norm_excluded: set = set()
        # What the next write_back copies from, per space (shard layout), when an update
        # prepared it (delayed update: the background thread); None: the masters themselves.
        self._sources: Optional[List[torch.Tensor]] = None
        # overlap_param_gather: the engine sets this; write_back then leaves the gathers to it.
        self.gather_overlap: Optional[ParamGatherOverlap] = None
        # (loss scale, gradient_clipping) of the backward in progress: the engine sets this; the
        # 1-bit momentum exchange clips each rank's own gradient before it sends.
        self.step_scalars: Callable[[], Tuple[float, float]] = lambda: (1.0, 0.0)
        # offload_optimizer.overlap_step: the host share steps during the boundary backward.
        self.backward_step: Optional[BackwardStep] = None
        if self.offload is not None and self.offload.overlap_step:
            self.backward_step = reducer.host_step = BackwardStep(self, self.offload.clip_with_previous_norm)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The torch optimizer over the masters (built by the engine from config or the client's)."""
        self.check_compressor(self.reducer.compressor, optimizer)
        self.optimizer = optimizer
        self._bind(self.reducer.compressor)

    def set_compression(self, reduction) -> None:
        """The reducer's new Reduction, once the optimizer can run with it (1-bit: Adam only)."""
        self.check_compressor(reduction.compressor, self.optimizer)
        self._bind(reduction.compressor)
        self.reducer.set_compression(reduction)

    @staticmethod
    def check_compressor(compressor: object, optimizer: torch.optim.Optimizer) -> None:
        """A compressor that freezes Adam's variance (1-bit) needs an Adam or AdamW."""
        if hasattr(compressor, "freezes_variance"):
            check_freezable(optimizer, getattr(compressor, "sends_momentum", False))

    def _bind(self, compressor: object) -> None:
        """The 1-bit momentum exchange reads beta1 and this rank's momentum from the optimizer."""
        if getattr(compressor, "sends_momentum", False) and self.optimizer is not None:
            compressor.source = OptimizerMomentum(self.optimizer, self.masters, self.reducer,
                                                  lambda: self.step_scalars())

    @property
    def master_device(self) -> torch.device:
        """Where the masters, their gradients and the optimizer state live (with partial
        offload, the device; each master's own `.device` says where it is)."""
        whole = self.offload is not None and all(s.offloaded for s in self.spaces)
        return torch.device("cpu") if whole else self.topo.device

    def master_groups(self) -> List[List[torch.nn.Parameter]]:
        """Masters grouped by the optimizer group their parameters came from."""
        n = 1 + max((s.group_index for s in self.spaces), default=-1)
        groups: List[List[torch.nn.Parameter]] = [[] for _ in range(n)]
        for space, master in zip(self.spaces, self.masters):
            groups[space.group_index].append(master)
        return groups

    def _sum_of_squares(self, grads: Optional[List[torch.Tensor]] = None,
                        host_squares: Optional[float] = None) -> torch.Tensor:
        """Squared norm of this rank's master gradients (still scaled), summed over ranks.
        `host_squares`: the host spaces' part, already summed by the backward step."""
        per_space = [m.grad for m in self.masters] if grads is None else grads
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for g, space in zip(per_space, self.spaces):
            if g.numel() > 0 and not (host_squares is not None and space.offloaded):
                by_device.setdefault(g.device, []).append(g)  # partial offload: summed apart
        parts = [_square_sum(gs).to(self.topo.device) for gs in by_device.values()]
        if host_squares is not None:
            parts.append(torch.tensor(host_squares, dtype=torch.float32, device=self.topo.device))
        local = torch.stack(parts).sum() if parts else \
            torch.zeros((), dtype=torch.float32, device=self.topo.device)
        if self.norm_excluded:  # clamped: rounding must not turn an all-tied norm negative (nan)
            local = (local - self._excluded_squares(per_space)).clamp_min(0)
        if self.topo.world_size > 1 and self.reducer.sharded:
            local = local.to(self.topo.device)  # host gradients (offload): NCCL reduces device tensors
            dist.all_reduce(local, group=self.topo.group)  # inf/nan anywhere reaches every rank
        if self.topo.model_group is not None:  # the other pipeline stages' parameters
            local = local.to(self.topo.device)
            dist.all_reduce(local, group=self.topo.model_group)
        return local

    def _excluded_squares(self, grads: List[torch.Tensor]) -> torch.Tensor:
        """Squared norm of the norm_excluded parameters' part of this rank's master gradients
        (`grads` as the masters: one per space, in shard layout)."""
        parts = []
        for space, grad in zip(self.spaces, grads):
            for p, o in space.param_offsets():
                if id(p) not in self.norm_excluded:
                    continue
                end = o + space.shapes[id(p)].numel()
                for _, lo, hi, off in space.shard_slices():
                    a, b = max(o, lo), min(end, hi)
                    if a < b:
                        parts.append(grad[off + a - lo:off + b - lo].double().square().sum())
        if not parts:
            return torch.zeros((), device=grads[0].device if grads else self.topo.device)
        return torch.stack(parts).sum().float()

    def grad_divisor(self, loss_scale: float) -> float:
        """What the reduced master gradients must be divided by to be the true mean gradient."""
        summed_ranks = self.topo.world_size if (self.reducer.distributed and not self.reducer.predivide) else 1
        return loss_scale * summed_ranks

    def step(self, loss_scale: float, clip: float) -> StepOutcome:
        """Global norm and overflow check (one host sync), clip, update, gather parameters."""
        self.flush()  # delayed update: the previous step's update reaches the parameters now
        try:
            if self.backward_step is not None and self.backward_step.armed:
                return self._finish_overlapped(self.reducer.master_grads(), loss_scale)
            return self._step(self.reducer.master_grads(), loss_scale, clip)
        finally:
            self.reducer.release_master_grads()

    def _finish_overlapped(self, grads: List[torch.Tensor], loss_scale: float) -> StepOutcome:
        """overlap_step: the host share has stepped during backward; agree on the norm, then
        keep that (stepping the device share of a partial offload alike) or roll it back."""
        bs = self.backward_step
        squares = self._sum_of_squares(grads, host_squares=bs.settle())
        grad_norm = math.sqrt(squares.item()) / self.grad_divisor(loss_scale)
        if not math.isfinite(grad_norm):
            if bs.rollback():  # stepped buckets had reached the device: the old values go back
                self.write_back()
            return StepOutcome(applied=False, overflow=True, grad_norm=grad_norm)
        kept = [(m, g) for m, g, s in zip(self.masters, grads, self.spaces) if not s.offloaded]
        if kept:
            step_masters([m for m, _ in kept], [g for _, g in kept], bs.coef, self.optimizer)
        staged, uploaded = bs.commit(grad_norm)
        self._sources = [staged.get(i, m.detach()) for i, m in enumerate(self.masters)]
        self.write_back(uploaded)
        return StepOutcome(applied=True, overflow=False, grad_norm=grad_norm)

    def prepare(self, loss_scale: float, clip: float) -> Tuple[StepOutcome, Optional[Update]]:
        """The step's decision (norm, overflow, clip coefficient) without the update: what
        replicas in replay mode send to the buddy before `apply` writes into the masters. The
        hyperparameters are frozen now, so the LR scheduler may step before `apply`. No
        write_back: the caller runs it after `apply`."""
        self.flush()
        grads = self.reducer.master_grads()
        outcome, coef = self._decide(grads, loss_scale, clip)
        if not outcome.applied:
            self.reducer.release_master_grads()
            return outcome, None
        return outcome, Update(grads, coef, frozen_hyperparameters(self.optimizer), self._frozen_variance())

    def apply(self, update: Optional[Update]) -> None:
        """Apply what `prepare` decided (nothing after an overflow)."""
        if update is None:
            return
        try:
            self._update(update.grads, update.coef, update.optimizer, update.frozen)
        finally:
            self.reducer.release_master_grads()

    def _decide(self, grads: List[torch.Tensor], loss_scale: float, clip: float) -> Tuple[StepOutcome, float]:
        """(outcome, the factor that unscales and clips the gradients): one host sync."""
        divisor = self.grad_divisor(loss_scale)
        grad_norm = math.sqrt(self._sum_of_squares(grads).item()) / divisor
        if not math.isfinite(grad_norm):
            return StepOutcome(applied=False, overflow=True, grad_norm=grad_norm), 0.0
        coef = 1.0 / divisor
        # A 1-bit momentum step's "gradients" are the momentum, its ranks clipped before sending.
        frozen = self._frozen_variance()
        if clip > 0 and grad_norm > clip and not (frozen and frozen.momentum_given):
            coef *= clip / (grad_norm + 1e-6)
        if self.backward_step is not None:  # clip_with_previous_norm's next coefficient
            self.backward_step.last_norm = grad_norm
        return StepOutcome(applied=True, overflow=False, grad_norm=grad_norm), coef

    def _step(self, grads: List[torch.Tensor], loss_scale: float, clip: float) -> StepOutcome:
        outcome, coef = self._decide(grads, loss_scale, clip)
        if not outcome.applied:
            return outcome
        frozen = self._frozen_variance()
        if self.offload is not None and self.offload.delayed:
            job = partial(self._update, grads, coef, frozen_hyperparameters(self.optimizer), frozen)
            self.offload.runner.submit(job)
            self.offload.flip_grad_buffers()  # the next window must not land into `grads`
        else:
            self._update(grads, coef, self.optimizer, frozen)
            self.write_back()
        return outcome

    def _frozen_variance(self) -> Optional[FrozenStep]:
        """How the step runs when this step's gradients came through a 1-bit exchange (with
        momentum_given when that exchange delivered the momentum itself), else None (decided
        before the compressor's on_step advances it)."""
        c = self.reducer.compressor
        if c is None or not self.reducer.distributed or not getattr(c, "freezes_variance", False):
            return None
        return FrozenStep(getattr(c, "sends_momentum", False), c.update_bound)

    def _update(self, grads: List[torch.Tensor], coef: float, optimizer: torch.optim.Optimizer,
                frozen: Optional[FrozenStep] = None) -> None:
        """Unscale and clip the gradients, step the optimizer (in the DPU thread: no collectives)."""
        if self.offload is not None:
            self.offload.wait_uploads()  # a pinned master may still be the source of an upload
        step_masters(self.masters, grads, coef, optimizer, frozen)
        if self.offload is not None and self.offload.delayed:
            # Cast for the upload here, off the main thread; write_back then only copies.
            with torch.no_grad():
                self._sources = [self.offload.stage(m.detach(), s.dtype, key=i)
                                 for i, (s, m) in enumerate(zip(self.spaces, self.masters))]

    def flush(self) -> None:
        """Delayed update: wait for the update in flight and copy it into the parameters.

        With overlap_param_gather, also waits for the parameter all-gathers still in flight.
        A no-op otherwise. Collective (write_back all-gathers): every rank calls it together.
        """
        if self.gather_overlap is not None:
            self.gather_overlap.settle()
        if self.offload is not None and self.offload.runner is not None and self.offload.runner.wait():
            self.write_back()

    def close(self) -> None:
        """Land any delayed update and stop the offload's thread."""
        self.flush()
        if self.backward_step is not None:
            self.backward_step.rollback()  # a backward whose step never came
            self.backward_step.close()
        if self.offload is not None:
            self.offload.close()

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes this rank holds now, by role (what the ZeRO formulas count).

        With offload, the host spaces' masters, master gradients and optimizer state are
        reported under host_* keys (all of them unless offload_optimizer.ratio < 1).
        """
        grads = self.reducer.grads
        host = [self.offload is not None and s.offloaded for s in self.spaces]

        def state(m: torch.Tensor) -> int:
            if self.optimizer is None:
                return 0
            return sum(_nbytes(t) for t in self.optimizer.state.get(m, {}).values()
                       if torch.is_tensor(t) and t.numel() > 1)
        out = {
            "params": sum(_param_bytes(s) for s in self.spaces),
            "grads": sum(_nbytes(g.flat_grad) for g in grads if g.flat_grad is not None),
            "master_params": sum(_nbytes(m) for m, h in zip(self.masters, host) if not h),
            "master_grads": sum(_nbytes(g.master_grad) for g in grads
                                if g.master_grad is not None and g.offload is None),
            "optimizer_state": sum(state(m) for m, h in zip(self.masters, host) if not h),
        }
        if self.offload is not None:
            out.update(host_master_params=sum(_nbytes(m) for m, h in zip(self.masters, host) if h),
                       host_master_grads=self.offload.grad_bytes(),
                       host_optimizer_state=sum(state(m) for m, h in zip(self.masters, host) if h),
                       host_pinned=self.offload.pinned_bytes())
        return out

    @torch.no_grad()
    def write_back(self, uploaded: Optional[set] = None) -> None:
        """Copy masters into the rank's slices of the flat params, then all-gather each bucket
        (with overlap_param_gather: in forward order, left in flight, see overlap.py). Each
        bucket's gather is issued right after its copy, so an offloaded upload of the next
        bucket overlaps the gather of this one. `uploaded`: the (space, shard offset) slices the
        overlapped host step has copied already (backward_step.py)."""
        overlap = self.gather_overlap
        if overlap is not None:
            overlap.settle()  # the last step's gathers still write into the buffers
        sources = self._sources or [m.detach() for m in self.masters]
        self._sources = None
        slices = {(si, bucket.index): (space, source, bucket, lo, hi, off)
                  for si, (space, source) in enumerate(zip(self.spaces, sources))
                  for bucket, lo, hi, off in space.shard_slices()}
        keys = list(slices)
        if overlap is not None:  # unsharded and stage-3 slices first, then forward order
            keys.sort(key=lambda k: overlap.position.get(k, -1))
        works = []
        for key in keys:
            space, source, bucket, lo, hi, off = slices[key]
            if space.local_shard is not None:  # stage 3: only the shard persists
                self.copy_into(space.local_shard[off:off + hi - lo], source[off:off + hi - lo])
                continue
            if uploaded is None or (key[0], off) not in uploaded:  # (overlap_step uploads its own)
                self.copy_into(space.flat[lo:hi], source[off:off + hi - lo])
            if space.num_shards > 1:
                whole = space.flat[bucket.start:bucket.start + bucket.numel]
                works.append(comm.all_gather(whole, space.flat[lo:hi], group=self.topo.group,
                                            async_op=True))
        if self.offload is not None:
            self.offload.uploads_done()
        if overlap is not None:
            overlap.start(works)
            return
        for w in works:
            w.wait()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Master values (fp32, or pre-cast by a delayed update) into a device tensor slice.

        Offloaded: cast on the host, then an asynchronous host-to-device copy, queued before any
        collective that reads `dst`.
        """
        if self.offload is not None:
            self.offload.upload(dst, src)
        else:
            dst.copy_(src)


def _param_bytes(space: FlatSpace) -> int:
    """The flat buffer's live storage (0 for a released stage-3 unit) plus any local shard."""
    shard = _nbytes(space.local_shard) if space.local_shard is not None else 0
    return space.flat.untyped_storage().nbytes() + shard


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
