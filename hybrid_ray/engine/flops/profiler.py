"""The engine's flops profiler: one training micro-step counted, the next one timed.

Config `flops_profiler {enabled, profile_step, ...}` reports once, on rank 0, for the micro-step
that starts after `profile_step` optimizer steps (step 0 warms up, as in DeepSpeed). A
Speedometer asks for a silent profile with `request()` to learn the flops of a step. Counting
(FlopCounterMode) and timing (hooks) run in different micro-steps: under the counting mode every
op passes through Python dispatch and the times would mostly measure that.

The engine calls the hooks below from forward/backward; idle, each is one comparison.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn as nn

from hybrid_ray.config import FlopsProfilerConfig
from .counter import FlopsCapture, LatencyTimer, Profile, add_latency, batch_shape, clock
from .report import format_report

log = logging.getLogger("hybrid_ray")

_IDLE, _COUNTING, _COUNTED, _TIMING = "idle", "counting", "counted", "timing"


class StepProfiler:
    """Profiles a training micro-step (forward + backward) of `module` when due or asked."""

    def __init__(self, config: FlopsProfilerConfig, module: nn.Module, rank: int,
                 device_type: str):
        self.config, self.module, self.rank, self.device_type = config, module, rank, device_type
        self.last: Optional[Profile] = None
        """The latest complete profile (flops, params, latencies), kept for readers such as
        the Speedometer."""
        self._state = _IDLE
        self._requested = False
        self._report_due = config.enabled
        self._capture: Optional[FlopsCapture] = None
        self._timer: Optional[LatencyTimer] = None
        self._profile: Optional[Profile] = None
        self._t0 = 0.0
        self._forward_s: Optional[float] = None
        self._shape: tuple = (None, None)

    def request(self) -> None:
        """Profile the next training micro-step without printing; the result lands in `last`."""
        self._requested = True

    # ---- hooks the engine calls --------------------------------------------------------------
    def before_forward(self, global_steps: int, args: tuple, kwargs: dict) -> None:
        if not (self.module.training and torch.is_grad_enabled()):
            return  # evaluation forwards have no backward to pair with
        if self._state == _IDLE and (self._requested or self._due(global_steps)):
            self._capture = FlopsCapture(self.module)
            self._capture.start()
            self._state = _COUNTING
            self._shape = batch_shape(args, kwargs)
        elif self._state == _COUNTED:
            self._timer = LatencyTimer(self.module, self.device_type)
            self._timer.start()
            self._state = _TIMING
            self._t0 = clock(self.device_type)

    def after_forward(self) -> None:
        if self._state == _COUNTING:
            self._capture.mark_forward_done()
        elif self._state == _TIMING:
            self._forward_s = clock(self.device_type) - self._t0

    def before_backward(self) -> None:
        if self._state == _TIMING:
            self._t0 = clock(self.device_type)

    def after_backward(self) -> None:
        if self._state == _COUNTING:
            totals = self._capture.stop()
            self._profile = self._capture.build(totals, self._capture.forward_counts)
            self._capture, self._state = None, _COUNTED
        elif self._state == _TIMING:
            backward_s = clock(self.device_type) - self._t0
            self._finish(self._timer.stop(), backward_s)

    def close(self) -> None:
        """Leave the counting mode and remove hooks if a profile was cut short."""
        if self._capture is not None:
            self._capture.stop()
        if self._timer is not None:
            self._timer.stop()
        self._capture = self._timer = None
        self._state = _IDLE

    # ---- internals -------------------------------------------------------------------------
    def _due(self, global_steps: int) -> bool:
        return self._report_due and global_steps >= self.config.profile_step

    def _finish(self, latency: dict, backward_s: float) -> None:
        profile = self._profile
        add_latency(profile, latency)
        profile.forward_s, profile.backward_s = self._forward_s, backward_s
        profile.samples, profile.tokens_per_sample = self._shape
        profile.title = "training micro-step (forward + backward)"
        profile.notes.append("flops counted in one micro-step, latencies timed in the next")
        self.last, self._profile, self._timer = profile, None, None
        self._state, self._requested = _IDLE, False
        if self._report_due:
            self._report_due = False
            if self.rank == 0:
                self._write(profile)

    def _write(self, profile: Profile) -> None:
        cfg = self.config
        text = format_report(profile, cfg.module_depth, cfg.top_modules, cfg.detailed)
        if cfg.output_file is None:
            print(text, end="", flush=True)
            return
        directory = os.path.dirname(cfg.output_file)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(cfg.output_file, "w", encoding="utf-8") as f:
            f.write(text)
        log.info("flops profile written to %s", cfg.output_file)
