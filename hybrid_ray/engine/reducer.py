"""Gradient reduction: from the parameters' gradients to this rank's fp32 master gradient.

Stage 0: every rank holds everything; buckets are all-reduced.
Stage 1: gradients stay whole on every rank (flat buffer, `.grad` are views); at the
  accumulation boundary each bucket is reduce-scattered into the rank's master-gradient slice.
Stage 2: no rank keeps whole gradients. Autograd's gradient for each parameter is packed into a
  transient bucket buffer as soon as the bucket is complete, reduce-scattered, and added into the
  rank's fp32 master gradient; the per-parameter gradients are freed at once. Because no rank can
  hold the sum of several micro-batches' full gradients, stage 2 reduces after every micro-batch
  (as ZeRO-2 does); stages 0 and 1 reduce only at the boundary.

With `overlap_comm` the collectives are launched from `register_post_accumulate_grad_hook` the
moment a bucket's last gradient lands, so they run while backward computes the earlier layers.
With one rank nothing is reduced: the master gradient is one cast-copy of the flat gradient.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import comm
from .flat import Bucket, FlatSpace
from .topology import Topology


class SpaceGrads:
    """The gradient side of one FlatSpace: flat gradient buffer and fp32 master gradient."""

    def __init__(self, space: FlatSpace, keep_flat_grads: bool):
        self.space = space
        # The fp32 master gradient lives only from the first reduction into it to the end of
        # the step: stages 0/1 reduce at the boundary, stage 2 from the first micro-batch of
        # the window on (it accumulates the micro-batches, so it starts zeroed).
        self.accumulates = not keep_flat_grads
        self.master_grad: Optional[torch.Tensor] = None
        self.flat_grad: Optional[torch.Tensor] = None
        if keep_flat_grads:
            self.flat_grad = torch.zeros(space.numel, dtype=space.dtype, device=space.device)
        self.pending: Dict[int, int] = {}
        self.shard_offset = {b.index: off for b, _, _, off in space.shard_slices()}

    def attach_grad_views(self) -> None:
        """Point every parameter's .grad at its slice of the flat buffer (stages 0/1)."""
        if self.flat_grad is None:
            return
        for p, view in zip(self.space.ordered_params(), self.space.views_of(self.flat_grad)):
            p.grad = view

    def bucket_input(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        """The bucket's gradients as one tensor of the reduction dtype."""
        if self.flat_grad is not None:
            src = self.flat_grad[bucket.start:bucket.start + bucket.numel]
            return src if src.dtype == dtype else src.to(dtype)
        buf = torch.zeros(bucket.numel, dtype=self.space.dtype, device=self.space.device)
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                 device=buf.device) for p in bucket.params]
        torch.cat(grads, out=buf[:bucket.content])
        for p in bucket.params:
            p.grad = None  # stage 2: the whole gradient is not kept
        return buf if dtype == buf.dtype else buf.to(dtype)

    def ensure_master_grad(self) -> torch.Tensor:
        if self.master_grad is None:
            alloc = torch.zeros if self.accumulates else torch.empty  # empty: fully overwritten
            self.master_grad = alloc(self.space.shard_numel, dtype=torch.float32, device=self.space.device)
        return self.master_grad

    def release_master_grad(self) -> None:
        self.master_grad = None

    def master_slice(self, bucket: Bucket) -> torch.Tensor:
        off = self.shard_offset[bucket.index]
        return self.ensure_master_grad()[off:off + bucket.numel // self.space.num_shards]


class GradReducer:
    """Moves gradients into master gradients, overlapped with backward where asked."""

    def __init__(self, spaces: List[FlatSpace], topo: Topology, stage: int,
                 reduce_dtype: torch.dtype, overlap: bool, use_reduce_scatter: bool):
        self.topo, self.stage = topo, stage
        self.reduce_dtype = reduce_dtype
        self.distributed = topo.world_size > 1
        self.partitioned_grads = stage >= 2 and self.distributed
        self.sharded = stage >= 1 and self.distributed  # masters differ between ranks
        self.overlap = overlap and self.distributed
        self.use_reduce_scatter = use_reduce_scatter
        # Half-precision sums over many ranks can overflow: divide before reducing. fp32 sums
        # are divided after, folded into the single unscale multiply of the step.
        self.predivide = self.distributed and reduce_dtype != torch.float32
        self.grads = [SpaceGrads(s, keep_flat_grads=not self.partitioned_grads) for s in spaces]
        self._armed = False
        self._inflight: List[Callable[[], None]] = []
        self._accumulate = False
        self._hooks = []
        if self.overlap:
            self._register_hooks()

    # ---- per-window bookkeeping -------------------------------------------------------
    def start_window(self) -> None:
        """Called before the first micro-batch's backward of an accumulation window."""
        for g in self.grads:
            if g.flat_grad is not None:
                g.flat_grad.zero_()
                g.attach_grad_views()
            g.release_master_grad()

    def before_backward(self, boundary: bool) -> None:
        """Arm the bucket hooks when this backward must reduce (stage 2: every micro-batch)."""
        self._armed = self.distributed and (boundary or self.partitioned_grads)
        self._accumulate = self.partitioned_grads
        for g in self.grads:
            g.pending = {b.index: len(b.params) for b in g.space.buckets}

    def after_backward(self) -> None:
        """Reduce whatever the hooks did not launch, then wait for all collectives."""
        if self._armed:
            for g in self.grads:
                for b in g.space.buckets:
                    if g.pending.get(b.index, 0) > 0:
                        g.pending[b.index] = 0
                        self._launch(g, b)
        for finish in self._inflight:
            finish()
        self._inflight.clear()
        self._armed = False

    def finish_window(self) -> None:
        """Single rank: the master gradient is the flat gradient, cast to fp32."""
        if self.distributed:
            return
        for g in self.grads:
            master_grad = g.ensure_master_grad()
            for b, lo, hi, off in g.space.shard_slices():
                master_grad[off:off + hi - lo].copy_(g.flat_grad[lo:hi])

    def master_grads(self) -> List[torch.Tensor]:
        return [g.ensure_master_grad() for g in self.grads]

    def release_master_grads(self) -> None:
        for g in self.grads:
            g.release_master_grad()

    # ---- hooks and collectives --------------------------------------------------------
    def _register_hooks(self) -> None:
        for g in self.grads:
            for b in g.space.buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(g, b)))

    def _make_hook(self, g: SpaceGrads, b: Bucket) -> Callable:
        # The hook lives on the parameter, which outlives the engine; a strong reference would
        # keep the reducer (and through it the process group) alive until interpreter exit,
        # where tearing down gloo's threads aborts the process.
        reducer_ref, grads_ref = weakref.ref(self), weakref.ref(g)

        def hook(_param: torch.Tensor) -> None:
            reducer, grads = reducer_ref(), grads_ref()
            if reducer is None or grads is None or not reducer._armed:
                return
            left = grads.pending[b.index] - 1
            grads.pending[b.index] = left
            if left == 0:
                reducer._launch(grads, b)
        return hook

    def _launch(self, g: SpaceGrads, b: Bucket) -> None:
        data = g.bucket_input(b, self.reduce_dtype)
        if self.predivide:
            data = data / self.topo.world_size
        out = g.master_slice(b)
        group = self.topo.group
        if g.space.num_shards == 1:  # stage 0: every rank gets the whole sum
            work = dist.all_reduce(data, group=group, async_op=True)
            result = data
        elif self.use_reduce_scatter:
            direct = out.dtype == data.dtype and not self._accumulate
            result = out if direct else torch.empty(out.numel(), dtype=data.dtype, device=data.device)
            work = comm.reduce_scatter(result, data, group=group, async_op=True)
        else:  # reduce_scatter: false -> all-reduce and keep this rank's slice
            work = dist.all_reduce(data, group=group, async_op=True)
            lo = self.topo.rank * out.numel()
            result = data[lo:lo + out.numel()]
        self._inflight.append(lambda: self._finish(work, result, out))

    def _finish(self, work: dist.Work, result: torch.Tensor, out: torch.Tensor) -> None:
        work.wait()
        if result is out:
            return
        if self._accumulate:
            out.add_(result)
        else:
            out.copy_(result)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
