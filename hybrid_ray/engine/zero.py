"""The sharded optimizer: fp32 master shards, one fused step, parameters gathered back.

Composition, as in nanotron: a plain torch optimizer over fp32 master tensors (one per flat
space: this rank's shard), fed by the GradReducer, wrapped by this class which adds the global
gradient norm, overflow agreement, clipping and the all-gather of updated parameters.

Memory per parameter with Adam (ZeRO paper): stage 0 16 bytes; stage 1 4 + 12/N (half params
and half gradients whole, fp32 master and two moments sharded); stage 2 2 + 14/N (the gradient
too is sharded, kept in fp32 in the master gradient: 2 + 16/N here, plus one bucket in flight).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from . import comm
from .flat import FlatSpace
from .reducer import GradReducer
from .topology import Topology


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer boundary did."""

    applied: bool
    overflow: bool
    grad_norm: float  # true (unscaled) global norm before clipping; inf/nan on overflow


class ZeroOptimizer:
    """Owns the fp32 master shards and turns reduced gradients into updated parameters."""

    def __init__(self, spaces: List[FlatSpace], reducer: GradReducer, topo: Topology):
        self.spaces, self.reducer, self.topo = spaces, reducer, topo
        self.masters: List[torch.nn.Parameter] = []
        for space, grads in zip(spaces, reducer.grads):
            master = torch.nn.Parameter(space.gather_shard(space.flat).float())
            master.grad = grads.master_grad
            self.masters.append(master)
        self.optimizer: Optional[torch.optim.Optimizer] = None

    def master_groups(self) -> List[List[torch.nn.Parameter]]:
        """Masters grouped by the optimizer group their parameters came from."""
        n = 1 + max((s.group_index for s in self.spaces), default=-1)
        groups: List[List[torch.nn.Parameter]] = [[] for _ in range(n)]
        for space, master in zip(self.spaces, self.masters):
            groups[space.group_index].append(master)
        return groups

    def _sum_of_squares(self) -> torch.Tensor:
        """Squared norm of this rank's master gradients (still scaled), summed over ranks."""
        grads = [m.grad for m in self.masters if m.grad.numel() > 0]
        if not grads:
            local = torch.zeros((), dtype=torch.float32, device=self.topo.device)
        else:
            norms = torch._foreach_norm(grads, 2.0)
            local = torch.stack(norms).square().sum()
        if self.topo.world_size > 1 and self.reducer.sharded:
            dist.all_reduce(local, group=self.topo.group)  # inf/nan anywhere reaches every rank
        return local

    def grad_divisor(self, loss_scale: float) -> float:
        """What the reduced master gradients must be divided by to be the true mean gradient."""
        summed_ranks = self.topo.world_size if (self.reducer.distributed and not self.reducer.predivide) else 1
        return loss_scale * summed_ranks

    def step(self, loss_scale: float, clip: float) -> StepOutcome:
        """Global norm and overflow check (one host sync), clip, update, gather parameters."""
        divisor = self.grad_divisor(loss_scale)
        scaled_norm = math.sqrt(self._sum_of_squares().item())
        grad_norm = scaled_norm / divisor
        if not math.isfinite(grad_norm):
            return StepOutcome(applied=False, overflow=True, grad_norm=grad_norm)
        coef = 1.0 / divisor
        if clip > 0 and grad_norm > clip:
            coef *= clip / (grad_norm + 1e-6)
        torch._foreach_mul_([m.grad for m in self.masters], coef)
        self.optimizer.step()
        self.write_back()
        return StepOutcome(applied=True, overflow=False, grad_norm=grad_norm)

    @torch.no_grad()
    def write_back(self) -> None:
        """Cast masters into the rank's slices of the flat params, then all-gather buckets."""
        works = []
        for space, master in zip(self.spaces, self.masters):
            for bucket, lo, hi, off in space.shard_slices():
                space.flat[lo:hi].copy_(master[off:off + hi - lo])
                if space.num_shards > 1:
                    whole = space.flat[bucket.start:bucket.start + bucket.numel]
                    works.append(comm.all_gather(whole, space.flat[lo:hi], group=self.topo.group,
                                                async_op=True))
        for w in works:
            w.wait()
