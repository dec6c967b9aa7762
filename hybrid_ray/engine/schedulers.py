"""DeepSpeed's warmup learning-rate schedules as torch ``LRScheduler`` subclasses.

``build_scheduler(cfg, optimizer)`` builds DeepSpeed's ``scheduler`` section
(``{"type": "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR", "params": {...}}``) as the config
loader validated it (hybrid_ray/config/optim.py).

Step convention (DeepSpeed's): the schedule index ``i`` is DeepSpeed's
``last_batch_iteration``, which starts at -1. Constructing the scheduler sets the
optimizer's lr for ``i = -1`` (the warmup start); the k-th ``scheduler.step()`` sets
it for ``i = k - 1``. In torch terms ``i = scheduler.last_epoch - 1``. So optimizer
step t (0-based, the scheduler stepped once after each applied optimizer step) runs
with the lr for ``i = t - 1``; the first two steps both run at the warmup start
because ``log(0 + 1) = 0``. This reproduces DeepSpeed's lr sequence exactly.

Checkpoints hold progress only (the step counters and last lrs), not the schedule
parameters: as in DeepSpeed, the config given on resume defines the schedule, so
``total_num_steps`` can be extended for a resumed run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence, Union

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hybrid_ray.config.loader import load_dataclass
from hybrid_ray.config.optim import SchedulerConfig

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
_PROGRESS_KEYS = ("last_epoch", "_step_count", "_last_lr")

PerGroup = Union[float, Sequence[float]]


def warmup_gamma(i: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at schedule index ``i`` (< warmup_num_steps).

    log: ``log(i + 1) / log(warmup_num_steps)``; linear: ``i / warmup_num_steps``.
    """
    if warmup_type == WARMUP_LOG:
        return math.log(i + 1) / math.log(warmup_num_steps)
    return i / warmup_num_steps


class _WarmupBase(LRScheduler):
    """Shared plumbing: validation, DeepSpeed's index, progress-only checkpoints."""

    def __init__(self, optimizer: Optimizer, warmup_num_steps: int, warmup_type: str) -> None:
        name = type(self).__name__
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
            raise ValueError(f"{name}: warmup_num_steps must be an integer >= 0, got {warmup_num_steps!r}")
        if warmup_type not in (WARMUP_LOG, WARMUP_LINEAR):
            raise ValueError(f"{name}: warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        # log(1) = 0 would divide by zero; DeepSpeed lifts the warmup to 2 steps too (0 and 1
        # included, which the config schema and DeepSpeed accept).
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    @property
    def schedule_index(self) -> int:
        """DeepSpeed's ``last_batch_iteration``: -1 at construction, +1 per step()."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        """The lr of every param group at the current schedule index."""
        return self.lrs_at(self.schedule_index)

    def lrs_at(self, i: int) -> list[float]:
        """The lr of every param group at schedule index ``i``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Progress only; the schedule's shape comes from the config on resume."""
        return {key: self.__dict__[key] for key in _PROGRESS_KEYS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore progress and put the restored lrs into the optimizer at once.

        Writing the lrs here (torch only does so on the next step) makes a resume
        correct even when the optimizer was rebuilt without its saved state.
        """
        self.__dict__.update({key: state_dict[key] for key in _PROGRESS_KEYS})
        for group, lr in zip(self.optimizer.param_groups, self.lrs_at(self.schedule_index)):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def _per_group(optimizer: Optimizer, value: PerGroup, name: str, owner: str) -> list[float]:
    """Broadcast a scalar to all param groups, or check a list has one per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{owner}: {name} has {len(value)} values but the optimizer has {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


class WarmupLR(_WarmupBase):
    """Absolute lrs: ``warmup_min_lr -> warmup_max_lr`` over the warmup, then flat.

    ``lr(i) = min + (max - min) * gamma(i)`` with :func:`warmup_gamma` for
    ``i < warmup_num_steps`` and ``gamma = 1`` after; ``lr(-1) = min``. The optimizer's
    own lr is overridden, as in DeepSpeed. min/max may be one value per param group.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
    ) -> None:
        name = type(self).__name__
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr", name)
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr", name)
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def gamma(self, i: int) -> float:
        """Position between min (0) and max (1) at schedule index ``i``."""
        if i < self.warmup_num_steps:
            return warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, i: int) -> list[float]:
        """``min + (max - min) * gamma(i)`` per group; min before the first step."""
        if i < 0:
            return list(self.min_lrs)
        g = self.gamma(i)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay from max to 0 at ``total_num_steps``.

    After warmup ``gamma(i) = max(0, (total - i) / max(1, total - warmup_num_steps))``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
    ) -> None:
        _check_total(type(self).__name__, total_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self, i: int) -> float:
        """Warmup as in WarmupLR, then the linear decay fraction."""
        if i < self.warmup_num_steps:
            return warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
        span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, (self.total_num_steps - i) / span)


class WarmupCosineLR(_WarmupBase):
    """Ratio of each group's own lr: warmup to 1, then cosine down to ``cos_min_ratio``.

    Warmup (``i < warmup_num_steps``): ``ratio = wmin + (1 - wmin) * gamma(i)``.
    After: ``p = min(1, (i - warmup_num_steps + 1) / max(1, total - warmup_num_steps))``,
    ``ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2)``; it stays at
    ``cos_min_ratio`` past ``total_num_steps``. ``lr(-1) = 0`` as in DeepSpeed. The
    base lr of a group is its lr when the scheduler was first built (``initial_lr``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
    ) -> None:
        _check_total(type(self).__name__, total_num_steps)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def ratio(self, i: int) -> float:
        """Multiplier of the base lr at schedule index ``i``."""
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            g = warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        done = i - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, i: int) -> list[float]:
        """Each group's base lr times the shared ratio."""
        r = self.ratio(i)
        return [base * r for base in self.base_lrs]


def _check_total(owner: str, total_num_steps: Any) -> None:
    """total_num_steps is required and must be a positive integer."""
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
        raise ValueError(f"{owner}: total_num_steps must be a positive integer, got {total_num_steps!r}")


_SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _as_section(cfg: Any) -> SchedulerConfig:
    """The validated `scheduler` section: as given when it came through the config loader,
    else (a dict, a namespace, a dataclass of params) loaded by that same loader, so a caller
    outside `initialize` gets the same one-line errors naming `scheduler.<key>`."""
    if isinstance(cfg, SchedulerConfig):
        return cfg
    if isinstance(cfg, Mapping):
        raw = dict(cfg)
    else:
        raw = {"type": cfg.type, "params": getattr(cfg, "params", None) or {}}
    params = raw.get("params")
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        raw["params"] = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return load_dataclass(SchedulerConfig, raw, "scheduler")


def build_scheduler(cfg: Any, optimizer: Optimizer) -> Optional[LRScheduler]:
    """Build the scheduler named by ``cfg.type`` with ``cfg.params``; None if no cfg.

    ``cfg`` is the config's validated SchedulerConfig (anything else goes through the config
    loader first), so names and parameters are not checked again here.
    """
    if cfg is None or (not isinstance(cfg, Mapping) and getattr(cfg, "type", None) is None):
        return None
    section = _as_section(cfg)
    params = {f.name: getattr(section.params, f.name) for f in dataclasses.fields(section.params)}
    return _SCHEDULERS[section.type](optimizer, **params)
