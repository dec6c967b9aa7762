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

A bucket's first reduction in a window overwrites its slice of the master gradient; later ones
(stage 2's further micro-batches) add to it, so the master gradient is never zeroed.

With `gradient_compression: topk` (compression/topk.py) a bucket is exchanged as the (index, value)
pairs of its largest entries, with `powersgd` (compression/powersgd.py) as low-rank factors, instead of
reduced densely; the sum lands in the master gradient the same way, so everything after the
reduction is unchanged. `set_compression` switches the method between optimizer steps: the old
method's error-feedback residuals are carried and added into each bucket's next reduction.

With optimizer offload (offload.py) the master gradient is a persistent host buffer: a reduced
bucket lands there through the offload's side-stream copy as soon as its collective finishes,
and with one rank the buckets are streamed to the host from the same hooks (nothing to reduce).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from hybrid_ray.config.sections import ZeroConfig

from .. import comm
from ..compression import Reduction
from ..compression.base import BucketKey, host_copies
from ..compression.stats import CommStats, StepTimer
from ..topology import Topology
from .backward_step import land_in_place
from .flat import Bucket, FlatSpace
from .offload import HostOffload


@dataclass(frozen=True)
class ReduceOptions:
    """How the reducer moves gradients (from the config's zero_optimization section).

    stage: 0 all-reduce, 1 reduce-scatter at the boundary, 2 reduce-scatter every micro-batch
      (stage 3 reduces as stage 2 does).
    overlap: launch each bucket's collective from the gradient hooks, during backward.
    reduce_scatter: stages 1-2 reduce-scatter; False all-reduces and keeps the rank's slice.
    max_inflight: finish the oldest collective beyond this many in flight (None: only at the
      end of backward).
    """

    stage: int
    overlap: bool = True
    reduce_scatter: bool = True
    max_inflight: Optional[int] = None

    @classmethod
    def from_config(cls, zc: ZeroConfig, partition_params: bool) -> "ReduceOptions":
        # A collective holds its input (the packed bucket) until someone waits on it. Stage 3
        # packs one whole unit per bucket, so keeping every reduction of a backward in flight
        # holds all units' packed gradients at once; finishing the oldest beyond two (FSDP2
        # keeps one) bounds that.
        return cls(min(zc.stage, 2), zc.overlap_comm, zc.reduce_scatter,
                   max_inflight=2 if partition_params else None)


class SpaceGrads:
    """The gradient side of one FlatSpace: flat gradient buffer and fp32 master gradient."""

    def __init__(self, space: FlatSpace, keep_flat_grads: bool, index: int = 0,
                 offload: Optional[HostOffload] = None):
        self.space, self.index, self.offload = space, index, offload
        # On the device the fp32 master gradient lives only from the first reduction into it to
        # the end of the step: stages 0/1 reduce at the boundary, stage 2 from the first
        # micro-batch of the window on. Offloaded, it is a persistent host buffer.
        self.master_grad: Optional[torch.Tensor] = None
        self.landed: Set[int] = set()  # buckets reduced into the master gradient this window
        self.flat_grad: Optional[torch.Tensor] = None
        if keep_flat_grads:
            self.flat_grad = torch.zeros(space.numel, dtype=space.dtype, device=space.device)
        self.pending: Dict[int, int] = {}
        self.shard_offset = {b.index: off for b, _, _, off in space.shard_slices()}
        self._layouts: Dict[int, List[Tuple[int, torch.Size]]] = {}

    def layout(self, bucket: Bucket) -> List[Tuple[int, torch.Size]]:
        """(bucket-relative offset, shape) of each parameter: how powersgd finds matrices."""
        if bucket.index not in self._layouts:  # shapes from the space: stage 3 empties .data
            self._layouts[bucket.index] = [(off - bucket.start, self.space.shapes[id(p)])
                                           for p, off in zip(bucket.params, bucket.offsets)]
        return self._layouts[bucket.index]

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
        # Packed straight into the reduction dtype: one pass over the gradients casts and
        # concatenates (a half-precision staging copy plus a cast cost ~3% of a 1.3B step).
        buf = torch.empty(bucket.numel, dtype=dtype, device=self.space.device)
        if bucket.numel > bucket.content:
            buf[bucket.content:].zero_()  # padding to a multiple of the world size
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                 device=buf.device) for p in bucket.params]
        torch.cat(grads, out=buf[:bucket.content])
        for p in bucket.params:
            p.grad = None  # stage 2: the whole gradient is not kept
        return buf

    def ensure_master_grad(self) -> torch.Tensor:
        if self.master_grad is None:
            numel = self.space.shard_numel
            if self.offload is not None:
                self.master_grad = self.offload.grad_buffer(self.index, numel)
            else:  # empty: every bucket's first landing of the window overwrites its slice
                self.master_grad = torch.empty(numel, dtype=torch.float32, device=self.space.device)
        return self.master_grad

    def release_master_grad(self) -> None:
        self.master_grad = None
        self.landed.clear()

    def mark_landed(self, bucket: Bucket) -> bool:
        """Record a reduction of `bucket`; True when it must add to an earlier one (accumulate)."""
        accumulate = bucket.index in self.landed
        self.landed.add(bucket.index)
        return accumulate

    def master_slice(self, bucket: Bucket) -> torch.Tensor:
        off = self.shard_offset[bucket.index]
        return self.ensure_master_grad()[off:off + bucket.numel // self.space.num_shards]


class GradReducer:
    """Moves gradients into master gradients, overlapped with backward where asked."""

    def __init__(self, spaces: List[FlatSpace], topo: Topology, options: ReduceOptions,
                 reduction: Reduction = Reduction(), offload: Optional[HostOffload] = None):
        stage = options.stage
        self.topo, self.stage, self.offload = topo, stage, offload
        self.stats = CommStats()
        self.timer = StepTimer(topo.device)  # exposed waits and compression time per step
        self.max_inflight = options.max_inflight
        self.distributed = topo.world_size > 1
        self.partitioned_grads = stage >= 2 and self.distributed
        self.sharded = stage >= 1 and self.distributed  # masters differ between ranks
        # Buckets travel from the hooks when they must be reduced, or (offload) copied to the host.
        self.streams = self.distributed or offload is not None
        self.overlap = options.overlap and self.streams
        # gloo's reduce-scatter takes about twice as long as its all-reduce of the same tensor
        # (2 CPU ranks, 5.3M fp32 elements: 30.6 ms against 16.5 ms); there the all-reduce is
        # the faster way to the same slice. NCCL's reduce-scatter moves half the bytes.
        self.use_reduce_scatter = options.reduce_scatter and topo.backend != "gloo"
        # Residuals of a compressor switched away from, added into each bucket's next reduction.
        self.carry: Dict[BucketKey, torch.Tensor] = {}
        self.compressor = None
        self.set_compression(reduction)
        self.grads = [SpaceGrads(s, not self.partitioned_grads, i, offload if s.offloaded else None)
                      for i, s in enumerate(spaces)]
        self._armed = self._host_armed = False
        self.host_step = None  # overlap_step: a BackwardStep takes a boundary's host buckets
        self._inflight: List[Callable[[], None]] = []
        self._hooks = []
        if self.overlap:
            self._register_hooks()

    def set_compression(self, reduction: Reduction) -> None:
        """Use this reduction from the next window on (between optimizer steps only).

        reduction.compressor: a topk/powersgd exchange of each bucket (values travel in fp32),
        or None for a dense reduction in `reduction.dtype`. The previous compressor's residuals
        move to `carry`, so what it held back is still sent, by whichever method comes next.
        """
        reduce_dtype, compressor = reduction.dtype, reduction.compressor
        old = self.compressor
        if old is not None:
            for key, r in old.residuals.items():
                prev = self.carry.get(key)
                self.carry[key] = r if prev is None else prev.add_(r)
            old.residuals.clear()
        self.compressor = compressor
        if compressor is not None:
            compressor.timer = self.timer
        self.reduce_dtype = reduce_dtype
        # What a reduction would carry uncompressed: the baseline of stats' ratio.
        self.dense_itemsize = (reduction.dense_dtype or reduce_dtype).itemsize
        # Half-precision sums over many ranks can overflow: divide before reducing. fp32 sums
        # are divided after, folded into the single unscale multiply of the step.
        self.predivide = self.distributed and reduce_dtype != torch.float32 and compressor is None

    # ---- per-window bookkeeping -------------------------------------------------------
    def start_window(self) -> None:
        """Called before the first micro-batch's backward of an accumulation window."""
        for g in self.grads:
            if g.flat_grad is not None:
                g.flat_grad.zero_()
                g.attach_grad_views()
            g.release_master_grad()

    def before_backward(self, boundary: bool) -> None:
        """Arm the bucket hooks when this backward must reduce (stage 2: every micro-batch,
        unless the compressor needs each rank's whole window gradient: then autograd sums the
        micro-batches into .grad and the buckets go at the boundary, as at stage 1)."""
        whole = self.compressor is not None and getattr(self.compressor, "needs_whole_window", False)
        self._armed = self.streams and (boundary or (self.partitioned_grads and not whole))
        for g in self.grads:
            g.pending = {b.index: len(b.params) for b in g.space.buckets}
        self._host_armed = self._armed and boundary and self.host_step is not None and self.host_step.arm()

    def hold(self) -> None:
        """Disarm the hooks for backwards that only accumulate: a pipeline schedule runs every
        micro-batch's backward, and the buckets are reduced once afterwards
        (before_backward(True) then after_backward()), at stage 2 too (autograd sums the
        micro-batches into .grad meanwhile)."""
        self._armed = False

    def after_backward(self) -> None:
        """Reduce whatever the hooks did not launch, then wait for all collectives."""
        if self._armed:
            for g in self.grads:
                for b in g.space.buckets:
                    if g.pending.get(b.index, 0) > 0:
                        g.pending[b.index] = 0
                        self._launch(g, b)
        self.drain()
        self._armed = self._host_armed = False

    def drain(self) -> None:
        """Finish every collective still in flight (a backward cut short by an error leaves
        some; the engine's destroy() calls this before it drops the group)."""
        inflight, self._inflight = self._inflight, []
        for finish in inflight:
            finish()

    def finish_window(self) -> None:
        """Single rank: the master gradient is the flat gradient, cast to fp32."""
        if self.streams:  # done bucket by bucket during backward
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
        # One rank (offload only): widened to fp32 on the device, the copy lands directly in the
        # host master gradient (a host-side widen costs more than the extra bytes, which
        # travel while backward runs).
        if self.compressor is not None and self.distributed:
            self._launch_compressed(g, b)
            return
        dtype = self.reduce_dtype if self.distributed else torch.float32
        data = self._with_carry(g, b, g.bucket_input(b, dtype))
        if self.distributed:
            self.stats.add(data.numel() * data.element_size(), b.numel * self.dense_itemsize)
        if self.predivide:
            data = data / self.topo.world_size
        out = g.master_slice(b)
        accumulate = g.mark_landed(b)
        group = self.topo.group
        work: Optional[dist.Work] = None
        if not self.distributed:  # offload with one rank: nothing to reduce, only to copy
            result = data
        elif g.space.num_shards == 1:  # stage 0: every rank gets the whole sum
            work = dist.all_reduce(data, group=group, async_op=True)
            result = data
        elif self.use_reduce_scatter:
            direct = out.dtype == data.dtype and out.device == data.device and not accumulate
            result = out if direct else torch.empty(out.numel(), dtype=data.dtype, device=data.device)
            work = comm.reduce_scatter(result, data, group=group, async_op=True)
        else:  # reduce_scatter: false -> all-reduce and keep this rank's slice
            work = dist.all_reduce(data, group=group, async_op=True)
            lo = self.topo.rank * out.numel()
            result = data[lo:lo + out.numel()]
        if g.offload is not None and self._host_armed:  # the host step takes the bucket once landed
            land = self.offload.land(work, result, out, accumulate, data) if result.device != out.device \
                else partial(land_in_place, work, result, out, accumulate)
            self._inflight.append(self.host_step.submit(g.index, g.shard_offset[b.index], out, land))
        elif result.device != out.device:  # offloaded to the host: copy on the side stream now
            land = self.offload.land(work, result, out, accumulate, data)
            self._inflight.append(lambda: self._host_wait(land))
        else:
            self._track(lambda: self._finish(work, result, out, accumulate))

    def _launch_compressed(self, g: SpaceGrads, b: Bucket) -> None:
        """Top-k or PowerSGD: the compressor exchanges the bucket and sums this rank's slice."""
        data = self._with_carry(g, b, g.bucket_input(b, torch.float32))
        out = g.master_slice(b)
        accumulate = g.mark_landed(b)
        lo, hi = b.shard_range(g.space.rank, g.space.num_shards)
        sent, finish = self.compressor.exchange((g.index, b.index), data, lo - b.start, hi - b.start,
                                                self.topo.group, g.layout(b))
        self.stats.add(sent, b.numel * self.dense_itemsize)
        self._track(lambda: self._finish(None, finish(), out, accumulate))

    def _with_carry(self, g: SpaceGrads, b: Bucket, data: torch.Tensor) -> torch.Tensor:
        """The bucket's gradients plus any residual carried over from a switched-away method
        (a new tensor: `data` may be the flat gradient buffer itself)."""
        carried = self.carry.pop((g.index, b.index), None)
        if carried is None:
            return data
        return (data.float() + carried).to(data.dtype)

    def _host_wait(self, land: Callable[[], None]) -> None:
        with self.timer.span("comm_wait", host=True):  # blocks the host on every device
            land()

    def _track(self, finish: Callable[[], None]) -> None:
        self._inflight.append(finish)
        if self.max_inflight is not None and len(self._inflight) > self.max_inflight:
            self._inflight.pop(0)()

    def end_step(self, overflow: bool, scale_ratio: float) -> None:
        """After an optimizer step: close the step's bytes and times; keep residuals (the
        compressor's and any carried ones) in the new loss scale, drop them after an overflow."""
        c = self.compressor
        self.stats.end_step(self.timer.collect(), c is not None and c.warming)
        if c is not None:
            c.on_step(overflow, scale_ratio)
        if overflow:
            self.carry.clear()
        elif scale_ratio != 1.0:
            for r in self.carry.values():
                r.mul_(scale_ratio)

    def compression_state(self) -> dict:
        """This rank's compression state on the host (residuals, warm-up, PowerSGD's factors)."""
        c = self.compressor
        return {"carry": host_copies(self.carry), "compressor": None if c is None else c.state_dict(),
                "kind": None if c is None else type(c).__name__}

    def load_compression_state(self, state: dict) -> None:
        """What compression_state() returned, for the same method (else it is left as is)."""
        c = self.compressor
        if state["kind"] != (None if c is None else type(c).__name__):
            return
        self.carry = {k: v.to(self.topo.device) for k, v in state["carry"].items()}
        if c is not None:
            c.load_state_dict(state["compressor"], self.topo.device)

    def _finish(self, work: Optional[dist.Work], result: torch.Tensor, out: torch.Tensor,
                accumulate: bool) -> None:
        self.timer.wait(work)
        if result is out:
            return
        if accumulate:
            out.add_(result)
        else:
            out.copy_(result)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
