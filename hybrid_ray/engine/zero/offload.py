"""Optimizer offload to host memory (ZeRO-Offload): masters, master gradients and optimizer state
live in CPU memory and the optimizer steps on the CPU.

Where each byte lives, per rank, with Adam, half-precision parameters and N ranks:
  device: the half-precision parameters (2 bytes/param; stage 3: 2/N), stage 1's whole half
          gradients (+2), and transient reduce buffers while a bucket is on its way to the host;
  host:   fp32 master shard (4/N), fp32 master-gradient shard (4/N, twice with
          delayed_param_update), optimizer state (8/N for Adam).

One step, in order:
  backward  each bucket, once its reduction finishes, is copied to the host on a side stream
            (non_blocking into pinned memory) while backward computes the earlier layers; the
            side stream waits on the collective, the compute stream does not. With one rank
            there is nothing to reduce and the bucket is copied (widened to fp32 on the device)
            as soon as its last gradient lands.
  boundary  the host gradients are complete; the global norm is taken over them and agreed in
            one scalar all-reduce (overflow and clipping, as without offload);
  CPU step  unscale/clip (one multiply) and the torch optimizer's fused CPU kernel (several
            times faster than foreach or the for-loop on the CPU, see `cpu_optimizer_kwargs`);
  upload    each master slice is cast to the parameters' half dtype on the host (half the bytes
            to move), copied non_blocking into the rank's slice of the device parameters, then
            all-gathered as without offload (stage 3 copies into its local shard instead).

Delayed parameter update (DPU, ZeRO-Offload paper section 5.2; `delayed_param_update: true`):
the CPU step of boundary t runs in a background thread while the forward and backward of step
t+1 run, and its result reaches the device at boundary t+1. Write w_0 for the initial weights
and w_t = U(w_{t-1}, g_t) for the masters after update t (U: unscale, clip, optimizer step).
Without DPU, g_t is computed on w_{t-1}. With DPU, g_t is computed on w_{max(t-2, 0)}: the
parameters are one step stale, from the first step on (steps 1 and 2 both see w_0), while the
update itself always applies to the current master w_{t-1}. The global norm, the overflow check
and clipping of g_t are computed before the thread starts (they need a collective, and every
collective stays on the main thread so ranks issue them in the same order). A skipped step
(overflow) launches nothing: the pending update of the previous step still lands at that
boundary, the skipped gradient is dropped, and the next boundary has nothing to land. The last
update lands only when the engine is asked (`Engine.finish_delayed_update()`, `close()`, a
precision switch); read, evaluate or save the weights after that call. The learning rate and
other hyperparameters of update t are those in effect at boundary t (a snapshot is taken, so
the LR scheduler stepping in the main thread does not race with the thread reading them).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from hybrid_ray.config.sections import OffloadConfig
from .pinned import PinnedRegistry

log = logging.getLogger("hybrid_ray")
_CONVERT_SLICE = 1 << 26  # elements per slice of a converting device-to-host copy (256 MB as fp32)


class HostOffload:
    """The host side of optimizer offload: host buffers, device<->host copies, the DPU thread.

    Generic over the sharding stage: it hands out host tensors by key, lands reduced gradient
    buckets into them and uploads host values into whatever device tensor a caller names.
    On a CPU-only engine the "device" is the CPU too: masters still live in separate host
    buffers and the CPU optimizer runs, but every copy is synchronous and nothing is pinned.
    """

    def __init__(self, device: torch.device, pin_memory: bool, delayed: bool):
        self.device = device
        self.transfers = device.type == "cuda"  # device and host memory differ
        self.pin = pin_memory and self.transfers
        self.delayed = delayed
        self._stream = torch.cuda.Stream(device) if self.transfers else None
        self._uploaded: Optional[Any] = None  # cuda Event after the last batch of uploads
        # DPU double-buffers the master gradients: the thread reads one set while the next
        # backward lands into the other.
        self._grad_sets: List[Dict[int, torch.Tensor]] = [{} for _ in range(2 if delayed else 1)]
        self._current = 0
        self.runner = BackgroundStep() if delayed else None
        # overlap_step: the host share steps bucket by bucket during backward (backward_step.py)
        self.overlap_step = self.clip_with_previous_norm = False
        self.pinned = PinnedRegistry() if self.pin else None  # persistent buffers, exact sizes
        self._staging: Dict[tuple, torch.Tensor] = {}  # upload staging, one per (key, dtype)
        if self.transfers:
            configure_host_threads()

    @classmethod
    def from_config(cls, cfg: OffloadConfig, device: torch.device) -> Optional["HostOffload"]:
        """An offload for `offload_optimizer.device == 'cpu'`, else None."""
        if cfg.device != "cpu":
            return None
        offload = cls(device, cfg.pin_memory, cfg.delayed_param_update)
        offload.overlap_step, offload.clip_with_previous_norm = cfg.overlap_step, cfg.clip_with_previous_norm
        return offload

    # ---- host tensors -----------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A transient host tensor, pinned when pin_memory is set and there is a CUDA device.

        From torch's caching host allocator: it rounds blocks up to a power of two, which costs
        nothing for buffers that are freed and reused; persistent ones use `persistent`.
        """
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)

    def persistent(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor kept for the engine's life: page-locked at exactly its size (pinned.py)."""
        if self.pinned is None:
            return torch.empty(numel, dtype=dtype, device="cpu")
        return self.pinned.empty(numel, dtype)

    def pinned_bytes(self) -> int:
        """Page-locked host bytes this offload registered (its persistent buffers)."""
        return self.pinned.nbytes if self.pinned is not None else 0

    def to_host(self, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A persistent host copy of `tensor`, as `dtype` (a new buffer even on a CPU engine).

        Copied in slices: a copy that also converts converts on the source device first, and
        a whole-shard fp32 temporary there (32 GB for a 10B model's masters) is what offload
        exists to avoid."""
        out = self.persistent(tensor.numel(), dtype or tensor.dtype)
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), _CONVERT_SLICE):
            out[start:start + _CONVERT_SLICE].copy_(flat[start:start + _CONVERT_SLICE])
        return out.view(tensor.shape)

    def grad_buffer(self, key: int, numel: int) -> torch.Tensor:
        """The fp32 host master gradient for `key` in the current window (persistent)."""
        buffers = self._grad_sets[self._current]
        if key not in buffers:
            buffers[key] = self.persistent(numel, torch.float32)
        return buffers[key]

    def flip_grad_buffers(self) -> None:
        """DPU: the next window lands into the other set; the thread owns this one."""
        self._current = (self._current + 1) % len(self._grad_sets)

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._grad_sets for t in s.values())

    # ---- device -> host -----------------------------------------------------------------
    def land(self, work: Optional[dist.Work], result: torch.Tensor, dst: torch.Tensor,
             accumulate: bool, source: Optional[torch.Tensor] = None) -> Callable[[], None]:
        """Copy a reduced bucket (device) into its host master-gradient slice, asynchronously.

        The copy is queued now on the side stream behind the collective `work` (None: behind
        the compute stream), so it overlaps the rest of backward. The returned callable waits
        for it and finishes on the host: the add of an accumulation, or a cast from the reduce
        dtype (communication_data_type bf16: widened by the CPU). `source` is the
        collective's input: NCCL releases its own hold on it once a stream waits on the work,
        and here that stream is the side stream, not the one that allocated it, so the side
        stream must guard its memory too (else the next bucket reuses it mid-collective).
        """
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(result.device))
        with torch.cuda.stream(stream):
            if work is not None:
                work.wait()  # blocks this side stream, not the compute stream or the host
            direct = not accumulate and result.dtype == dst.dtype and dst.is_pinned()
            target = dst if direct else self.empty(result.numel(), result.dtype)
            target.copy_(result, non_blocking=True)
            result.record_stream(stream)  # freed by the compute stream: reused only after this copy
            if source is not None:
                source.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)

        def finish() -> None:
            _ = work  # held until the copy is done, as the reducer holds its collectives
            done.synchronize()
            if target is not dst:
                dst.add_(target) if accumulate else dst.copy_(target)
        return finish

    # ---- host -> device -----------------------------------------------------------------
    def stage(self, src: torch.Tensor, dtype: torch.dtype, key: Optional[int] = None) -> torch.Tensor:
        """`src` as the host tensor an upload into a `dtype` device tensor copies from.

        Cast on the host (a bf16 upload moves half the bytes of fp32) into pinned memory so the
        copy is asynchronous; a pinned tensor of the right dtype is used as is. A CPU engine
        needs no staging: its copy into the parameters casts directly. `key`: a whole master
        shard (the delayed update casts off the main thread), staged into a persistent buffer
        per (key, dtype), since a transient one that large would stay cached by torch's host
        allocator at twice its size; not double-buffered: the next cast into it comes after
        `wait_uploads`.
        """
        if not self.transfers or (src.dtype == dtype and src.is_pinned()):
            return src
        out = self.empty(src.numel(), dtype) if key is None else self.staging(key, src.numel(), dtype)
        out.copy_(src.reshape(-1))
        return out

    def staging(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The persistent upload staging buffer of master `key` in `dtype` (see `stage`)."""
        out = self._staging.get((key, dtype))
        if out is None or out.numel() != numel:
            out = self._staging[(key, dtype)] = self.persistent(numel, dtype)
        return out

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host values into a device tensor (queued on the current stream, non_blocking)."""
        if dst.device == src.device:
            dst.copy_(src)
            return
        staged = self.stage(src, dst.dtype)
        dst.copy_(staged.view_as(dst), non_blocking=staged.is_pinned())

    def uploads_done(self) -> None:
        """Mark the end of a batch of uploads; host writes into their sources wait for it."""
        if self.transfers:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.device))

    def wait_uploads(self) -> None:
        """Before the optimizer writes the masters: an upload may still be reading one."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.pinned is not None:
            if self.transfers:
                torch.cuda.synchronize(self.device)  # no copy may still read a buffer
            self._staging.clear()
            self.pinned.release()


class BackgroundStep:
    """At most one job (a DPU optimizer step) running in a background thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid_ray-offload")
        self._pending: Optional[Future] = None

    def submit(self, job: Callable[[], None]) -> None:
        assert self._pending is None, "wait() for the previous update first"
        self._pending = self._pool.submit(job)

    def wait(self) -> bool:
        """Wait for the pending job (re-raising its error); False when there was none."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        pending.result()
        return True

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def frozen_hyperparameters(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A view of `optimizer` whose param_groups are a snapshot (same params, same state dict).

    The DPU thread steps this view, so the LR scheduler (main thread, right after the step
    returns) changes the real groups for the next update without racing with this one.
    """
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = [dict(g) for g in optimizer.param_groups]
    # An LR scheduler replaces the instance's `step` with a wrapper bound to the optimizer
    # itself, which would step the live groups (the next step's lr once the scheduler has
    # moved): the view steps with the class's method, and the optimizer is marked as stepped
    # as that wrapper would have done (else the scheduler warns it stepped first).
    if view.__dict__.pop("step", None) is not None:
        optimizer._opt_called = True
    return view


def cpu_optimizer_kwargs(cls: type) -> Dict[str, bool]:
    """Implementation choice for an optimizer stepping on the CPU: fused where torch has it.

    Measured on this project's 2-core dev machine (torch 2.13, AVX512), AdamW over one
    50M-element fp32 tensor, 1 thread: fused 28 ms, foreach 183 ms, for-loop 293 ms (2 threads
    on a shared machine: no faster; the step is memory-bound). The fused kernel matches the
    for-loop to ~6e-9 relative after 5 steps.
    """
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], fused=True)  # raises where torch lacks the kernel
        return {"fused": True}
    except (RuntimeError, ValueError, TypeError):
        return {"foreach": True}


def configure_host_threads() -> Optional[int]:
    """Give the CPU optimizer this rank's share of the cores (GPU engines only).

    torchrun sets OMP_NUM_THREADS=1 when it starts several processes, which would leave the
    CPU step on one core; each rank gets cores / local ranks instead. A CPU engine's threads
    are left alone: they run the model too, and their count is the user's choice.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    want = max(1, cores // local)
    if torch.get_num_threads() >= want:
        return None
    log.info("optimizer offload: %d -> %d CPU threads for the host optimizer step",
             torch.get_num_threads(), want)
    torch.set_num_threads(want)
    return want
