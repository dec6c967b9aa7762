"""How a reduction's bytes and the step's time split: what `Engine.compression_stats()` reports."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist


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
    decompression; on CUDA device time of those kernels). `warming`: the step was reduced
    densely by a compressor still in its warm-up (what it sends then says nothing of its speed).
    """

    TIMES = ("comm_wait", "compress")

    def __init__(self) -> None:
        self._window = [0, 0]
        self.last = {"bytes_sent": 0, "dense_bytes": 0, "step_s": 0.0, "warming": False,
                     **{f"{k}_s": 0.0 for k in self.TIMES}}
        self.total = {"bytes_sent": 0, "dense_bytes": 0}
        self.steps = 0

    def add(self, sent: int, dense: int) -> None:
        self._window[0] += sent
        self._window[1] += dense

    def end_step(self, seconds: Optional[Dict[str, float]] = None, warming: bool = False) -> None:
        sent, dense = self._window
        seconds = seconds or {}
        self.last = {"bytes_sent": sent, "dense_bytes": dense, "step_s": self.last["step_s"], "warming": warming,
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
                "compress_s": self.last["compress_s"], "warming": self.last["warming"]}
