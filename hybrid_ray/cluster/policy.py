"""Decisions of the elastic driver, kept free of Ray so they can be tested alone.

The controller observes (group size, survivors, room in the cluster, each poll of the running
group) and asks these policies what to do; they return decisions and verdicts as small
dataclasses, the controller carries them out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from hybrid_ray.config.cluster import FailureConfig, ScalingConfig

from .status import FAILED, FINISHED, STOPPED, Member, PollStatus


@dataclass(frozen=True)
class Decision:
    """size: the group size to (re)form; None means keep going as is. reason: for the log."""

    size: Optional[int]
    reason: str


class ScalingPolicy:
    def __init__(self, scaling: ScalingConfig):
        self.scaling = scaling

    def _whole(self, n: int) -> int:
        """n rounded down to whole model replicas."""
        return n // self.scaling.replica_size * self.scaling.replica_size

    def initial(self, can_host: int) -> Decision:
        """The first group: as many workers as fit, up to max; fewer than min means wait."""
        size = self._whole(min(self.scaling.max_workers, can_host))
        if size < self.scaling.min_workers:
            return Decision(None, f"waiting for room: {can_host} worker(s) fit, "
                                  f"min_workers is {self.scaling.min_workers}")
        return Decision(size, f"starting with {size} worker(s)")

    def after_loss(self, survivors: int, can_add: int) -> Decision:
        """Re-form with the survivors plus whatever replacements fit, up to max."""
        size = self._whole(min(self.scaling.max_workers, survivors + can_add))
        if size < self.scaling.min_workers:
            return Decision(None, f"only {size} worker(s) available, min_workers is "
                                  f"{self.scaling.min_workers}")
        kept = min(survivors, size)
        return Decision(size, f"re-forming at {size} worker(s) ({kept} kept, {size - kept} new)")

    def growth(self, size: int, can_add: int) -> Decision:
        """Grow toward max when the cluster has room (carried out at a checkpoint boundary)."""
        target = self._whole(min(self.scaling.max_workers, size + can_add))
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


@dataclass
class Watch:
    """What the controller remembers of the generation it is watching."""

    world_size: int
    last_progress: float  # when the newest step was first seen (or the generation started)
    next_grow_check: float  # when to ask the cluster for room next
    newest: int = -1  # newest step any rank reported
    grow_to: Optional[int] = None  # every worker was asked to stop, to re-form at this size

    def observe(self, status: PollStatus, now: float) -> bool:
        """Note the poll's newest step; True when it is new (training moved on)."""
        if status.newest_step <= self.newest:
            return False
        self.newest, self.last_progress = status.newest_step, now
        return True

    def grow_due(self, now: float) -> bool:
        return self.grow_to is None and now > self.next_grow_check


@dataclass(frozen=True)
class Verdict:
    """What one poll of a running generation means.

    kind: keep (go on watching), finished (every rank returned), resize (every rank stopped at
    the checkpoint asked for, to re-form at `size`), failed (members `lost`, a training raised,
    or the group stalled: tear it down). detail: a failed worker's traceback, for the log.
    """

    kind: str
    reason: str = ""
    lost: Tuple[Member, ...] = ()
    size: Optional[int] = None
    detail: str = ""


KEEP = Verdict("keep")


def judge(status: PollStatus, watch: Watch, now: float, heartbeat_timeout_s: float) -> Verdict:
    """The verdict on one poll (after `watch.observe` saw it), in order of precedence."""
    if status.lost:
        return Verdict("failed", "worker lost", lost=status.lost)
    states = status.states()
    failed = [n for n in status.news.values() if n.state == FAILED]
    if failed:
        error = failed[0].error or ""
        last = error.strip().splitlines()[-1][:200] if error.strip() else "no error text"
        return Verdict("failed", "worker failed: " + last, detail=error)
    if states and len(states) == watch.world_size and all(s == FINISHED for s in states):
        return Verdict("finished")
    if states and watch.grow_to is not None and all(s in (STOPPED, FINISHED) for s in states):
        return Verdict("resize", size=watch.grow_to)
    if watch.newest >= 0 and stalled(watch.last_progress, now, heartbeat_timeout_s):
        return Verdict("failed", f"no step for {heartbeat_timeout_s:.0f} s")
    return KEEP


def rank_order(members: List[Member], replica_size: int = 1) -> List[Member]:
    """The members in rank order: round robin over their nodes, so that consecutive ranks sit
    on different nodes wherever the nodes allow. Rank r keeps its copy of the ZeRO shard on
    rank r+1 (engine/replicas): on another node, one node's loss never takes a shard and its
    copy together. Whole replicas of replica_size > 1 (one node each) keep their order."""
    if replica_size > 1:
        return list(members)
    by_node: Dict[str, List[Member]] = {}
    for m in members:
        by_node.setdefault(m.info.get("node_id", ""), []).append(m)
    queues = list(by_node.values())
    out: List[Member] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out
