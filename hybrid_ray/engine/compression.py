"""Gradient compression for the data-parallel reduction (config `gradient_compression`).

fp16/bf16 need nothing here: they set the reducer's reduction dtype (`reduction_setup`).

topk (with error feedback, as in Deep Gradient Compression): for each bucket a rank adds its
fp32 residual to the gradient, keeps the k largest-magnitude entries of that sum and carries
the rest as the new residual, so `sent + residual == gradient + old residual` exactly and
nothing is lost, only delayed. k is the same on every rank (it depends only on the bucket size
and the step), so the (index, value) pairs travel in one fixed-size all_gather per bucket (the
int32 indices bit-cast to float32 and packed behind the values): gloo and NCCL both do that,
neither has a sparse all-reduce. Each rank then sums the received pairs that fall into the
part of the bucket it keeps: the whole bucket at stage 0, its ZeRO shard slice at stages 1-3.
The result is the same dense sum the reduce-scatter would have produced, so averaging,
clipping and the optimizer continue unchanged.

powersgd: powersgd.py. Both compressors share the interface the reducer uses:
`exchange(key, grad, lo, hi, group, layout) -> (bytes sent, finish)`, `on_step`, `residuals`.

Residuals are in the units of the gradients the reducer sees (loss-scaled): the engine calls
`on_step` after every optimizer step to rescale them when the loss scale moves and to drop
them after an overflow (the sum that produced them held inf/NaN).
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import comm
from .precision import dtype_of

BucketKey = Tuple[int, int]  # (flat space index, bucket index)
Layout = Sequence[Tuple[int, torch.Size]]  # (bucket-relative offset, shape) of each parameter


class StepTimer:
    """Seconds spent per kind ('comm_wait', 'compress') in the current optimizer-step window.

    CPU (gloo): `time.perf_counter` around the code; a gloo `wait` blocks the host, so that is
    the time this rank stood still. CUDA: an NCCL `wait` only makes the compute stream wait, and
    compression kernels run asynchronously, so a pair of CUDA events brackets the span on the
    current stream instead: the gap is how long that stream stalled (or computed). The events
    are read in `collect`, after the optimizer step's one host sync (the gradient norm), so
    timing adds no synchronisation. `host=True` spans block the host on every device (an event
    synchronize): those are timed with perf_counter.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seconds: Dict[str, float] = defaultdict(float)
        self._events: List[Tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self, kind: str, host: bool = False) -> Iterator[None]:
        if self.cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
            return
        t0 = time.perf_counter()
        yield
        self._seconds[kind] += time.perf_counter() - t0

    def wait(self, work: Optional[dist.Work]) -> None:
        """Wait for a gradient collective, counting the time as exposed communication."""
        if work is not None:
            with self.span("comm_wait"):
                work.wait()

    def collect(self) -> Dict[str, float]:
        """The window's seconds per kind; starts the next window."""
        for kind, start, end in self._events:
            end.synchronize()  # recorded before the step's host sync: already complete
            self._seconds[kind] += start.elapsed_time(end) / 1e3
        out = dict(self._seconds)
        self._seconds.clear()
        self._events.clear()
        return out


class CommStats:
    """Bytes this rank contributes to gradient reductions (the last optimizer step and in total),
    and how the last step's wall time split.

    `bytes_sent` counts the payload a rank puts into the collectives (top-k: indices and values;
    powersgd: P, Q and the densely reduced part; dense: the reduced buffer); `dense_bytes` what
    the same reductions carry uncompressed (communication_data_type, fp32 by default). Wire
    traffic depends on the algorithm: a ring all_gather sends (N-1) payloads per rank, a ring
    all-reduce or reduce-scatter 2(N-1)/N or (N-1)/N of the buffer.

    Times of the last step window: `step_s` wall time from the window's first forward to the
    end of its optimizer step; `comm_wait_s` time this rank was blocked waiting for gradient
    collectives (exposed communication: with overlap only what backward did not hide; stage 3's
    parameter all-gathers and the step's own small all-reduce are not counted); `compress_s`
    time spent compressing (top-k selection; PowerSGD's matmuls, orthogonalisation and
    decompression; on CUDA device time of those kernels).
    """

    TIMES = ("comm_wait", "compress")

    def __init__(self) -> None:
        self._window = [0, 0]
        self.last = {"bytes_sent": 0, "dense_bytes": 0, "step_s": 0.0,
                     **{f"{k}_s": 0.0 for k in self.TIMES}}
        self.total = {"bytes_sent": 0, "dense_bytes": 0}
        self.steps = 0

    def add(self, sent: int, dense: int) -> None:
        self._window[0] += sent
        self._window[1] += dense

    def end_step(self, seconds: Optional[Dict[str, float]] = None) -> None:
        sent, dense = self._window
        seconds = seconds or {}
        self.last = {"bytes_sent": sent, "dense_bytes": dense, "step_s": self.last["step_s"],
                     **{f"{k}_s": seconds.get(k, 0.0) for k in self.TIMES}}
        self.total = {"bytes_sent": self.total["bytes_sent"] + sent,
                      "dense_bytes": self.total["dense_bytes"] + dense}
        self._window = [0, 0]
        self.steps += 1

    def record_step_time(self, seconds: float) -> None:
        self.last["step_s"] = seconds

    def summary(self) -> dict:
        sent, dense = self.last["bytes_sent"], self.last["dense_bytes"]
        return {"bytes_sent": sent, "dense_bytes": dense, "ratio": dense / sent if sent else 1.0,
                "total_bytes_sent": self.total["bytes_sent"],
                "total_dense_bytes": self.total["dense_bytes"], "steps": self.steps,
                "step_s": self.last["step_s"], "comm_wait_s": self.last["comm_wait_s"],
                "compress_s": self.last["compress_s"]}


class ErrorFeedback:
    """Per-bucket fp32 residuals kept in the loss scale's units; the base of both compressors."""

    def __init__(self, warmup_steps: int, error_feedback: bool):
        self.warmup_steps, self.error_feedback = warmup_steps, error_feedback
        self.residuals: Dict[BucketKey, torch.Tensor] = {}
        self.step = 0  # optimizer steps seen (on_step), drives the warm-up
        self.timer = StepTimer(torch.device("cpu"))  # the reducer hands in its own

    def on_step(self, overflow: bool, scale_ratio: float) -> None:
        """After an optimizer step: advance the warm-up; keep residuals in the new loss scale."""
        self.step += 1
        if overflow:
            self.residuals.clear()
        elif scale_ratio != 1.0:
            for r in self.residuals.values():
                r.mul_(scale_ratio)

    def residual_norm(self) -> float:
        return math.sqrt(sum(float(r.double().square().sum()) for r in self.residuals.values()))


class TopK(ErrorFeedback):
    """Top-k sparsification with error feedback and an exponential density warm-up."""

    def __init__(self, ratio: float, warmup_steps: int = 0, error_feedback: bool = True):
        super().__init__(warmup_steps, error_feedback)
        self.ratio = ratio

    def density(self) -> float:
        """1.0 at step 0, falling geometrically to `ratio` at `warmup_steps` and after."""
        if self.step >= self.warmup_steps:
            return self.ratio
        return self.ratio ** (self.step / self.warmup_steps)

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density() * numel)))

    def select(self, key: BucketKey, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, fp32 values) to send for one bucket; the remainder becomes the residual."""
        acc = grad.to(torch.float32, copy=True)  # never alias the flat gradient buffer
        residual = self.residuals.get(key)
        if residual is not None:
            acc.add_(residual)
        k = self.k_for(acc.numel())
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        values = acc[idx]
        if self.error_feedback:
            acc[idx] = 0.0  # what is sent leaves the residual; the rest waits for a later step
            self.residuals[key] = acc
        return idx.to(torch.int32), values

    def exchange(self, key: BucketKey, grad: torch.Tensor, lo: int, hi: int,
                 group: Optional[dist.ProcessGroup], layout: Optional[Layout] = None
                 ) -> Tuple[int, Callable[[], torch.Tensor]]:
        """Start the all_gather of this rank's pairs for one bucket (`layout` is not needed).

        Returns (payload bytes sent, finish): finish() waits and returns the fp32 sum over all
        ranks of the bucket's entries [lo, hi) (bucket-relative; this rank's part).
        """
        with self.timer.span("compress"):
            idx, values = self.select(key, grad)
            k = idx.numel()
            payload = torch.cat([values, idx.view(torch.float32)])
        world = dist.get_world_size(group)
        gathered = torch.empty(world * 2 * k, dtype=torch.float32, device=payload.device)
        work = comm.all_gather(gathered, payload, group=group, async_op=True)

        def finish() -> torch.Tensor:
            self.timer.wait(work)
            pairs = gathered.view(world, 2 * k)
            all_values = pairs[:, :k].reshape(-1)
            all_idx = pairs[:, k:].contiguous().view(torch.int32).reshape(-1).long()
            out = torch.zeros(hi - lo, dtype=torch.float32, device=gathered.device)
            if lo == 0 and hi == grad.numel():
                return out.index_add_(0, all_idx, all_values)
            mine = (all_idx >= lo) & (all_idx < hi)
            return out.index_add_(0, all_idx[mine] - lo, all_values[mine])
        return payload.numel() * payload.element_size(), finish


def build_compressor(gc) -> Optional[ErrorFeedback]:
    """The compressor for a `gradient_compression` section (None: a dense reduction)."""
    if gc.type == "topk":
        return TopK(gc.topk_ratio, gc.warmup_steps, gc.error_feedback)
    if gc.type == "powersgd":
        from .powersgd import PowerSGD
        return PowerSGD(gc.rank, gc.warmup_steps, gc.error_feedback)
    return None


def reduction_setup(config) -> Tuple[torch.dtype, Optional[ErrorFeedback], torch.dtype]:
    """(reduction dtype, compressor, uncompressed dtype) for a Config.

    fp16/bf16 compression is a half-precision reduction (the config refuses a contradiction
    with communication_data_type); the uncompressed dtype is the baseline of the byte ratio.
    """
    gc, comm_dtype = config.gradient_compression, config.communication_data_type
    dense = dtype_of(comm_dtype or "fp32")
    reduce = dtype_of(gc.type) if gc.type in ("fp16", "bf16") else dense
    return reduce, build_compressor(gc), dense
