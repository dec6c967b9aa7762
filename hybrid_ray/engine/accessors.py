"""The Engine's DeepSpeed-compatible getters and counters, so engine.py keeps to training.

A mixin: it reads what the Engine builds (module, batch, optimizer, counters, the last step's
outcome, the loss scaler in force) and adds nothing of its own.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch


def _counter(name: str, doc: str) -> property:
    """An attribute of the Engine that lives in its StepCounters (checkpoints restore them)."""
    def get(self) -> int:
        return getattr(self.counters, name)

    def set(self, value: int) -> None:
        setattr(self.counters, name, value)

    return property(get, set, doc=doc)


class DeepSpeedAccessors:
    """DeepSpeed's engine getters under DeepSpeed's names."""

    global_steps = _counter("global_steps", "Optimizer steps taken (skipped ones included).")
    skipped_steps = _counter("skipped_steps", "Steps skipped for an overflow or a non-finite norm.")
    micro_steps = _counter("micro_steps", "engine.step() calls (micro-batches).")
    global_samples = _counter("global_samples", "Samples consumed by all ranks together.")

    def train(self, mode: bool = True) -> Any:
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        self.module.eval()
        return self

    def memory_breakdown(self) -> dict:
        """Bytes held by this rank for parameters, gradients, masters and optimizer state."""
        return self.zero.memory_breakdown()

    def was_step_applied(self) -> bool:
        return self._last is not None and self._last.applied

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self._last is None else self._last.grad_norm

    def get_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self._scaler.loss_scale

    @property
    def device(self) -> torch.device:
        return self.topology.device

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):
        return self.module.state_dict(*args, **kwargs)
