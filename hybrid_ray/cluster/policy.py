"""Decisions of the elastic driver, kept free of Ray so they can be tested alone.

The controller observes (group size, survivors, room in the cluster, checkpoint boundaries) and
asks these policies what to do; they return decisions, the controller carries them out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybrid_ray.config.cluster import FailureConfig, ScalingConfig


@dataclass(frozen=True)
class Decision:
    """size: the group size to (re)form; None means keep going as is. reason: for the log."""

    size: Optional[int]
    reason: str


class ScalingPolicy:
    def __init__(self, scaling: ScalingConfig):
        self.scaling = scaling

    def initial(self, can_host: int) -> Decision:
        """The first group: as many workers as fit, up to max; fewer than min means wait."""
        size = min(self.scaling.max_workers, can_host)
        if size < self.scaling.min_workers:
            return Decision(None, f"waiting for room: {can_host} worker(s) fit, "
                                  f"min_workers is {self.scaling.min_workers}")
        return Decision(size, f"starting with {size} worker(s)")

    def after_loss(self, survivors: int, can_add: int) -> Decision:
        """Re-form with the survivors plus whatever replacements fit, up to max."""
        size = min(self.scaling.max_workers, survivors + can_add)
        if size < self.scaling.min_workers:
            return Decision(None, f"only {size} worker(s) available, min_workers is "
                                  f"{self.scaling.min_workers}")
        return Decision(size, f"re-forming at {size} worker(s) ({survivors} kept, "
                              f"{size - survivors} new)")

    def growth(self, size: int, can_add: int) -> Decision:
        """Grow toward max when the cluster has room (carried out at a checkpoint boundary)."""
        target = min(self.scaling.max_workers, size + can_add)
        if target <= size:
            return Decision(None, "no room to grow")
        return Decision(target, f"cluster has room: growing from {size} to {target} worker(s)")


class FailurePolicy:
    def __init__(self, failure: FailureConfig):
        self.failure = failure

    def may_recover(self, failures: int) -> Decision:
        """After the `failures`-th failure: go on, or stop with the reason."""
        if self.failure.allows(failures):
            limit = "unlimited" if self.failure.max_failures < 0 else self.failure.max_failures
            return Decision(1, f"failure {failures} of {limit} allowed: recovering")
        return Decision(None, f"{failures} failures exceed failure.max_failures="
                              f"{self.failure.max_failures}")


def stalled(last_progress: float, now: float, timeout_s: float) -> bool:
    """No rank finished a step for timeout_s: the group is stuck (a frozen worker holds up a
    collective, or a collective hangs). The controller then stops the group; a worker whose
    training does not end within the collective timeout after that is frozen and is killed."""
    return now - last_progress > timeout_s
