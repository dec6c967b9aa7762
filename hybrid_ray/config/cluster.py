"""What the user tells the elastic trainer: how many workers, on what, and how much failure to bear.

Frozen dataclasses like every other config section, checked by the same loader whether they are
built in Python or loaded from a file: a bad value raises ConfigError naming the key
(`scaling.min_workers: out of range; got 0; allowed: >= 1`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Literal, Optional

from hybrid_ray.config.errors import ConfigError, Verbatim, config_error
from hybrid_ray.config.loader import check_fields, checked

# The Ray layer's settings fail like every other section; the old name stays importable.
ClusterConfigError = ConfigError


@dataclass(frozen=True)
class ScalingConfig:
    """How many workers and what each one holds."""

    min_workers: int = checked(1, ge=1)
    """The smallest group the run goes on with: it shrinks to this on losses."""
    max_workers: int = checked(1, ge=1)
    """The largest group: it grows toward this when the cluster has room (at a checkpoint)."""
    use_gpu: bool = False
    """Each worker owns one GPU (NCCL); otherwise some CPUs (gloo)."""
    resources_per_worker: Optional[Dict[str, float]] = None
    """Ray resources per worker; default {"CPU": 1} (+ {"GPU": 1} with use_gpu)."""
    placement_strategy: Literal["PACK", "SPREAD"] = "PACK"
    """PACK fills nodes first; SPREAD places one worker per node where it can."""
    replica_size: int = checked(1, ge=1)
    """Workers that together hold one model replica (tensor x pipeline parallel sizes): the
    group is always whole replicas, each placed on one node (a placement group), and a lost
    worker takes its replica's other workers out with it."""

    spare_workers: int = checked(0, ge=0)
    """Actors started ahead and kept waiting beside the group, their imports done: a lost worker
    is replaced from them at once instead of by a cold start, and they are started again in the
    background. They hold their resources while they wait (one model replica each needs
    replica_size 1)."""

    def __post_init__(self) -> None:
        check_fields(self, "scaling")

    def validate(self, path: str) -> None:
        """max_workers >= min_workers; resources are amounts, never negative."""
        if self.max_workers < self.min_workers:
            raise config_error(f"{path}.max_workers", "out of range", self.max_workers,
                               f"allowed: >= min_workers ({self.min_workers})")
        for key in ("min_workers", "max_workers"):
            if getattr(self, key) % self.replica_size:
                raise config_error(f"{path}.{key}", "not whole replicas", getattr(self, key),
                                   f"allowed: a multiple of replica_size ({self.replica_size})")
        if self.spare_workers and self.replica_size > 1:
            raise config_error(f"{path}.spare_workers", "needs replica_size 1", self.spare_workers,
                               "set it to 0 for groups of whole replicas (replica_size > 1)")
        for key, value in (self.resources_per_worker or {}).items():
            if value < 0:
                raise config_error(f"{path}.resources_per_worker.{key}", "out of range",
                                   Verbatim(repr(value)), "allowed: >= 0")

    def worker_resources(self) -> Dict[str, float]:
        res = dict(self.resources_per_worker or {})
        res.setdefault("CPU", 1.0)
        if self.use_gpu:
            res.setdefault("GPU", 1.0)
        return res


@dataclass(frozen=True)
class FailureConfig:
    """How much failure a run bears and how fast it notices."""

    max_failures: int = checked(3, ge=-1)
    """Membership changes caused by failures before the run gives up (-1: no limit)."""
    heartbeat_timeout_s: float = checked(60.0, gt=0)
    """No rank finished a step for this long: the group is stalled; it is stopped, and a worker
    whose training does not end after that is frozen and treated as lost."""
    collective_timeout_s: float = checked(120.0, gt=0)
    """torch.distributed timeout; a collective waiting on a vanished peer fails after this long
    at most (gloo usually fails at once when the peer's socket closes)."""
    start_timeout_s: float = checked(60.0, gt=0)
    """How long a new worker may wait to be placed, and a group to form."""
    poll_interval_s: float = checked(0.25, gt=0)
    """How often the driver asks the workers for news."""
    grow_check_interval_s: float = checked(2.0, gt=0)
    """How often the driver asks the cluster whether there is room to grow."""

    def __post_init__(self) -> None:
        check_fields(self, "failure")

    def allows(self, failures: int) -> bool:
        return self.max_failures < 0 or failures <= self.max_failures
