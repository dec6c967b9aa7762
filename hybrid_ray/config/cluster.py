"""What the user tells the elastic trainer: how many workers, on what, and how much failure to bear.

Plain frozen dataclasses checked on construction; a bad value raises ClusterConfigError naming
the field (`scaling.min_workers: ...`), like the engine's config errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

PLACEMENT = ("PACK", "SPREAD")


class ClusterConfigError(ValueError):
    """A scaling or failure setting is invalid; the message starts with its key."""


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ClusterConfigError(f"{key}: {msg}")


@dataclass(frozen=True)
class ScalingConfig:
    """How many workers and what each one holds.

    min_workers/max_workers: the group shrinks to min_workers on losses and grows toward
      max_workers when the cluster has room (at a checkpoint boundary).
    use_gpu: each worker owns one GPU (NCCL); otherwise CPUs (gloo).
    resources_per_worker: Ray resources per worker; default {"CPU": 1} (+ {"GPU": 1} with use_gpu).
    placement_strategy: PACK (fill nodes first) or SPREAD (one worker per node where possible).
    """

    min_workers: int = 1
    max_workers: int = 1
    use_gpu: bool = False
    resources_per_worker: Optional[Dict[str, float]] = None
    placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        _need(isinstance(self.min_workers, int) and self.min_workers >= 1, "scaling.min_workers",
              f"must be an integer >= 1, got {self.min_workers!r}")
        _need(isinstance(self.max_workers, int) and self.max_workers >= self.min_workers,
              "scaling.max_workers", f"must be an integer >= min_workers ({self.min_workers}), "
              f"got {self.max_workers!r}")
        _need(self.placement_strategy in PLACEMENT, "scaling.placement_strategy",
              f"must be one of {', '.join(PLACEMENT)}, got {self.placement_strategy!r}")
        for k, v in (self.resources_per_worker or {}).items():
            _need(isinstance(v, (int, float)) and v >= 0, f"scaling.resources_per_worker.{k}",
                  f"must be a number >= 0, got {v!r}")

    def worker_resources(self) -> Dict[str, float]:
        res = dict(self.resources_per_worker or {})
        res.setdefault("CPU", 1.0)
        if self.use_gpu:
            res.setdefault("GPU", 1.0)
        return res


@dataclass(frozen=True)
class FailureConfig:
    """How much failure a run bears and how fast it notices.

    max_failures: membership changes caused by failures before the run gives up (-1: no limit).
    heartbeat_timeout_s: a worker whose training made no step for this long while others did is
      frozen: it is killed and treated as lost.
    collective_timeout_s: torch.distributed timeout; a collective waiting on a vanished peer
      fails after this long at most (gloo usually fails at once when the peer's socket closes).
    start_timeout_s: how long a new worker may wait to be placed, and a group to form.
    poll_interval_s: how often the driver asks the workers for news.
    """

    max_failures: int = 3
    heartbeat_timeout_s: float = 60.0
    collective_timeout_s: float = 120.0
    start_timeout_s: float = 60.0
    poll_interval_s: float = 0.25
    grow_check_interval_s: float = 2.0

    def __post_init__(self) -> None:
        _need(isinstance(self.max_failures, int) and self.max_failures >= -1, "failure.max_failures",
              f"must be an integer >= -1 (-1: unlimited), got {self.max_failures!r}")
        for key in ("heartbeat_timeout_s", "collective_timeout_s", "start_timeout_s",
                    "poll_interval_s", "grow_check_interval_s"):
            v = getattr(self, key)
            _need(isinstance(v, (int, float)) and v > 0, f"failure.{key}", f"must be a number > 0, got {v!r}")

    def allows(self, failures: int) -> bool:
        return self.max_failures < 0 or failures <= self.max_failures
