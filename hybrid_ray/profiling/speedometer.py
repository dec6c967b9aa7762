"""Speedometer: throughput, TFLOPS, MFU and memory every `interval` optimizer steps.

    speedometer = hybrid_ray.Speedometer(engine, interval=100, on_report=tracker_callback)
    for x, y in loader:
        loss = criterion(engine(x), y); engine.backward(loss); engine.step()
        speedometer.update(loss)          # a record dict every 100 optimizer steps, else None

The flops of a step are measured once, on a real training micro-step, by the engine's flops
profiler (torch.utils.flop_counter), unless `flops_per_sample` is given; the measuring steps are
slow, so the window restarts after them. TFLOPS and MFU are per device. With activation
checkpointing the recomputed forward is counted too (hardware flops, strictly HFU).
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Any, Callable, Optional

import psutil
import torch

from hybrid_ray.engine.flops.counter import batch_shape

from .peaks import device_name, peak_flops as table_peak

GiB = float(2 ** 30)


class Speedometer:
    """Reports every `interval` optimizer steps; see the module docstring."""

    def __init__(self, engine: Any = None, interval: int = 100, peak_flops: Optional[float] = None,
                 flops_per_sample: Optional[float] = None, *, tokens_per_sample: Optional[int] = None,
                 on_report: Optional[Callable[[dict], None]] = None, verbose: bool = True,
                 model_engine: Any = None, args: Any = None, mp_size: int = 1):
        """engine (or model_engine, the seed's spelling): a hybrid_ray Engine, or any object with
        `global_steps` and `global_samples` counters.
        interval: optimizer steps per report.
        peak_flops: one device's peak FLOP/s for MFU (default: the table in peaks.py by device
          name and compute dtype; None on a CPU or an unlisted GPU, and MFU is then None).
        flops_per_sample: training flops (forward + backward) per sample; default: measured.
        tokens_per_sample: default: the sequence length of an integer (token id) input.
        on_report: called with each record (e.g. to send it to MLflow).
        verbose: print one line per report on rank 0.
        args, mp_size: the seed's signature; mp_size must be 1 (no model parallelism here)."""
        engine = engine if engine is not None else model_engine
        if engine is None:
            raise ValueError("Speedometer: engine: missing; pass the engine from initialize()")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"Speedometer: interval: out of range; got {interval!r}; allowed: an integer >= 1")
        if mp_size != 1:
            raise ValueError(f"Speedometer: mp_size: not supported; got {mp_size!r}; allowed: 1 "
                             "(no tensor or pipeline parallelism here)")
        self.engine, self.interval = engine, interval
        self.on_report, self.verbose = on_report, verbose
        self.flops_per_sample, self.tokens_per_sample = flops_per_sample, tokens_per_sample
        self.peak_flops = peak_flops if peak_flops is not None else self._table_peak()
        self.last: Optional[dict] = None
        self._t0: Optional[float] = None
        self._loss_sum: Any = 0.0
        self._loss_n = 0
        self._seen_profile = None

    # ---- the loop's call -----------------------------------------------------------------------
    def update(self, loss: Any = None) -> Optional[dict]:
        """Call once per iteration, after engine.step(); returns a record when one is due."""
        if self._t0 is None:  # the first call starts the clock: step 1 paid for set-up
            self._start_window()
            self._begin_measuring()
            return None
        self._add_loss(loss)
        if self._adopt_profile():
            self._start_window()  # the profiled micro-steps were slow: leave them out
            return None
        steps = self.engine.global_steps - self._steps0
        if steps < self.interval:
            return None
        record = self._record(steps)
        self._start_window()
        self.last = record
        if self.verbose and _rank(self.engine) == 0:
            print(format_record(record), flush=True)
        if self.on_report is not None:
            self.on_report(record)
        return record

    # ---- measuring flops and tokens ------------------------------------------------------------
    def _begin_measuring(self) -> None:
        profiler = getattr(self.engine, "flops_profiler", None)
        if self.flops_per_sample is None and profiler is not None and profiler.last is None:
            profiler.request()
        if self.tokens_per_sample is None and self.flops_per_sample is not None:
            self._watch_one_input()

    def _adopt_profile(self) -> bool:
        """Take flops (and tokens) per sample from a new profile of the engine, once."""
        profiler = getattr(self.engine, "flops_profiler", None)
        profile = None if profiler is None else profiler.last
        if profile is None or profile is self._seen_profile or self.flops_per_sample is not None:
            return False
        self._seen_profile = profile
        if profile.samples:
            self.flops_per_sample = profile.flops / profile.samples
        if self.tokens_per_sample is None:
            self.tokens_per_sample = profile.tokens_per_sample
        return True

    def _watch_one_input(self) -> None:
        module = getattr(self.engine, "module", None)
        if module is None:
            return

        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            handle.remove()
            if self.tokens_per_sample is None:
                self.tokens_per_sample = batch_shape(args, kwargs)[1]

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)

    # ---- the record --------------------------------------------------------------------------
    def _start_window(self) -> None:
        _sync(self.engine)
        self._t0 = time.perf_counter()
        self._steps0 = self.engine.global_steps
        self._samples0 = self.engine.global_samples
        self._loss_sum, self._loss_n = 0.0, 0

    def _add_loss(self, loss: Any) -> None:
        if loss is None:
            return
        self._loss_sum = self._loss_sum + (loss.detach().float() if torch.is_tensor(loss) else float(loss))
        self._loss_n += 1

    def _record(self, steps: int) -> dict:
        _sync(self.engine)
        dt = max(time.perf_counter() - self._t0, 1e-9)
        world = _world_size(self.engine)
        samples_per_s = (self.engine.global_samples - self._samples0) / dt
        flops_per_s = None if self.flops_per_sample is None else \
            self.flops_per_sample * samples_per_s / world
        allocated, peak = memory_bytes(_device(self.engine))
        loss = float(self._loss_sum) / self._loss_n if self._loss_n else None
        return dict(
            step=self.engine.global_steps, samples=self.engine.global_samples, loss=loss,
            samples_per_s=samples_per_s,
            tokens_per_s=None if self.tokens_per_sample is None else samples_per_s * self.tokens_per_sample,
            step_time_s=dt / steps, world_size=world,
            tflops=None if flops_per_s is None else flops_per_s / 1e12,
            mfu=None if flops_per_s is None or not self.peak_flops else flops_per_s / self.peak_flops,
            mem_allocated_gib=allocated / GiB, mem_peak_gib=peak / GiB)

    def _table_peak(self) -> Optional[float]:
        dtype = getattr(self.engine, "compute_dtype", torch.float32)
        return table_peak(device_name(_device(self.engine)), dtype)


def format_record(r: dict) -> str:
    """One line: 'step 100 | loss 2.3456 | 812.1 samples/s | ... '."""
    parts = [f"step {r['step']}"]
    if r.get("loss") is not None:
        parts.append(f"loss {r['loss']:.4f}")
    parts.append(f"{r['samples_per_s']:.1f} samples/s")
    if r.get("tokens_per_s") is not None:
        parts.append(f"{r['tokens_per_s']:.0f} tokens/s")
    if r.get("tflops") is not None:
        parts.append(f"{r['tflops']:.2f} TFLOPS/device")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['mem_allocated_gib']:.2f} GiB (peak {r['mem_peak_gib']:.2f})")
    return " | ".join(parts)


def memory_bytes(device: torch.device) -> tuple:
    """(allocated, peak) bytes: the CUDA caching allocator's on a GPU, the process RSS on a CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return rss, max(peak, rss)


def _device(engine: Any) -> torch.device:
    device = getattr(engine, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _world_size(engine: Any) -> int:
    topology = getattr(engine, "topology", None)
    return getattr(topology, "world_size", 1) or 1


def _rank(engine: Any) -> int:
    topology = getattr(engine, "topology", None)
    return getattr(topology, "rank", 0) or 0


def _sync(engine: Any) -> None:
    device = _device(engine)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
