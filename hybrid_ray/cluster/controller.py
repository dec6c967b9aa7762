"""The elastic driver: an explicit state machine over generations of a worker group.

    SCHEDULING -> RUNNING -> FINISHED
                     |--> (worker lost / failed / stalled) RECOVERING -> SCHEDULING
                     |--> (room to grow, at a checkpoint boundary) RESIZING -> SCHEDULING
    RECOVERING with failures beyond max_failures, or too few workers -> ERRORED

Every (re)formation is a new generation: the surviving actors stay (their processes are not
restarted), a fresh process group is formed at the new size, and the training function runs
again on every worker, resuming from the newest committed checkpoint.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import ray

from hybrid_ray.config.cluster import FailureConfig, ScalingConfig
from .group import Member, WorkerGroup
from .policy import FailurePolicy, ScalingPolicy, stalled
from .worker import FAILED, FINISHED, RUNNING, STOPPED

log = logging.getLogger("hybrid_ray.cluster")


def node_label(info: Dict[str, Any]) -> str:
    """How a node's system metrics are named (system/<label>/...): its IP, and the start of its
    Ray node id, since several nodes can share one IP (containers, ray.cluster_utils)."""
    return f"{info['ip']}-{info['node_id'][:6]}"


class TrainingFailedError(RuntimeError):
    """The run could not go on; the checkpoints written so far are intact."""


@dataclass
class Result:
    """What `fit()` returns: rank 0's return value and the run's history."""

    value: Any
    records: List[dict] = field(default_factory=list)
    events: List[str] = field(default_factory=list)
    generations: int = 0
    failures: int = 0
    world_sizes: List[int] = field(default_factory=list)


@dataclass
class _Outcome:
    kind: str  # finished | grow | failed
    value: Any = None
    lost: List[Member] = field(default_factory=list)
    reason: str = ""
    grow_to: Optional[int] = None


class Controller:
    def __init__(self, fn: Callable, scaling: ScalingConfig, failure: FailureConfig,
                 storage_path: str, run_name: str,
                 on_record: Optional[Callable[[dict], None]] = None,
                 on_event: Optional[Callable[[str], None]] = None,
                 node_metrics_interval_s: Optional[float] = None):
        self.fn, self.scaling, self.failure = fn, scaling, failure
        self.node_metrics_interval_s = node_metrics_interval_s
        self.storage_path, self.run_name = storage_path, run_name
        self.scaling_policy, self.failure_policy = ScalingPolicy(scaling), FailurePolicy(failure)
        self.group = WorkerGroup(scaling, run_name)
        self.result = Result(None)
        self._on_record, self._on_event = on_record, on_event
        self._last_step = -1
        self._failed_at: Optional[float] = None  # when the newest failure was detected
        self._directive: Optional[dict] = None  # newest send_directive(); new groups start with it

    # ---- the state machine ----------------------------------------------------------------
    def run(self) -> Result:
        try:
            size = self._initial_size()
            while True:
                self._schedule(size)
                outcome = self._run_generation()
                self.result.generations += 1
                if outcome.kind == "finished":
                    self.result.value = outcome.value
                    self._event(f"finished at step {self._last_step} with {len(self.group.members)} worker(s)")
                    return self.result
                if outcome.kind == "grow":
                    size = outcome.grow_to
                    continue
                size = self._recover(outcome)
        finally:
            self.group.shutdown()

    def _initial_size(self) -> int:
        deadline = time.monotonic() + self.failure.start_timeout_s
        while True:
            decision = self.scaling_policy.initial(self.group.can_add())
            if decision.size is not None:
                self._event(decision.reason)
                return decision.size
            if time.monotonic() > deadline:
                raise TrainingFailedError(f"cannot start: {decision.reason} after "
                                          f"{self.failure.start_timeout_s:.0f} s")
            time.sleep(1.0)

    def _schedule(self, size: int) -> None:
        """Bring the group to `size` members (add new actors; shrink by dropping the newest)."""
        missing = size - len(self.group.members)
        if missing > 0:
            placed = self.group.add(missing, self.failure.start_timeout_s)
            if len(self.group.members) < self.scaling.min_workers:
                raise TrainingFailedError(
                    f"only {len(self.group.members)} worker(s) could be placed, min_workers is "
                    f"{self.scaling.min_workers}; checkpoints in {self.storage_path} are intact")
            if len(placed) < missing:
                self._event(f"{len(placed)} of {missing} new worker(s) placed; going on with "
                            f"{len(self.group.members)}")
        elif missing < 0:
            self.group.remove(self.group.members[size:])

    def _recover(self, outcome: _Outcome) -> int:
        self.result.failures += 1
        decision = self.failure_policy.may_recover(self.result.failures)
        lost = ", ".join(f"worker {m.index}" for m in outcome.lost) or "no worker"
        if decision.size is None:
            raise TrainingFailedError(f"{outcome.reason} ({lost} lost); {decision.reason}; "
                                      f"checkpoints in {self.storage_path} are intact")
        self.group.remove(outcome.lost)
        survivors = len(self.group.members)
        time.sleep(0.5)  # let Ray return the lost workers' resources before counting room
        step = self._scaling_decision(survivors)
        self._event(f"{outcome.reason}: {lost} lost; {step.reason}, resuming from the newest "
                    f"checkpoint (last step seen {self._last_step})")
        return step.size

    def _scaling_decision(self, survivors: int):
        deadline = time.monotonic() + self.failure.start_timeout_s
        while True:
            decision = self.scaling_policy.after_loss(survivors, self.group.can_add())
            if decision.size is not None:
                return decision
            if time.monotonic() > deadline:
                raise TrainingFailedError(f"{decision.reason}; checkpoints in {self.storage_path} are intact")
            time.sleep(1.0)

    # ---- one generation ------------------------------------------------------------------
    def _run_generation(self) -> _Outcome:
        members = self.group.members
        world = len(members)
        self.result.world_sizes.append(world)
        master = members[0]
        port = master.handle.free_port.remote()
        try:
            port = ray.get(port, timeout=30)
        except ray.exceptions.RayError:
            return _Outcome("failed", lost=[master], reason="worker lost before the group formed")
        specs = {m.index: dict(rank=r, world_size=world, master_addr=master.info["ip"],
                               master_port=port, generation=self.result.generations,
                               use_gpu=self.scaling.use_gpu,
                               threads=int(self.group.resources.get("CPU", 1)) or 1,
                               collective_timeout_s=self.failure.collective_timeout_s,
                               storage_path=self.storage_path, run_name=self.run_name,
                               directive=self._directive)
                 for r, m in enumerate(members)}
        started = self.group.start(self.fn, specs)
        dead = [m for m in members if isinstance(started.get(m.index), Exception)]
        if dead:
            return self._teardown(dead, "worker lost while starting")
        self._monitor_nodes()
        return self._watch(world)

    def send_directive(self, directive: dict) -> None:
        """Hand every worker a directive (e.g. a gradient compression setting); the training
        function decides when the ranks apply it (WorkerContext.agree_on_directive). Workers
        of later groups start with the newest one."""
        self._directive = directive
        for m in self.group.members:  # fire and forget: a lost worker shows up in the next poll
            m.handle.set_directive.remote(directive)

    def _monitor_nodes(self) -> None:
        """One worker per node samples that node's system metrics (records `system_metrics`);
        the others stop. Asked again each generation: the sampling worker may have been lost."""
        if not self.node_metrics_interval_s:
            return
        first: Dict[str, Member] = {}
        for m in self.group.members:
            first.setdefault(m.info["node_id"], m)
        for m in self.group.members:  # fire and forget: a lost worker shows up in the next poll
            label = node_label(m.info) if first[m.info["node_id"]] is m else None
            m.handle.monitor_node.remote(label, self.node_metrics_interval_s)

    def _watch(self, world: int) -> _Outcome:
        started = time.monotonic()
        last_progress, newest = started, -1
        next_grow_check = started + self.failure.grow_check_interval_s
        stop_sent = None
        while True:
            time.sleep(self.failure.poll_interval_s)
            news = self.group.poll(timeout_s=max(5.0, self.failure.poll_interval_s * 4))
            lost = [m for m in self.group.members if isinstance(news[m.index], ray.exceptions.RayActorError)]
            if lost:
                return self._teardown(lost, "worker lost")
            states = {i: n["state"] for i, n in news.items() if isinstance(n, dict)}
            self._forward(news)
            steps = [n["step"] for n in news.values() if isinstance(n, dict)]
            if steps and max(steps) > newest:
                newest, last_progress = max(steps), time.monotonic()
                self._note_recovery(newest)
            if any(s == FAILED for s in states.values()):
                first = next(n["error"] for n in news.values() if isinstance(n, dict) and n["state"] == FAILED)
                log.warning("a worker failed:\n%s", first)
                return self._teardown([], "worker failed: " + first.strip().splitlines()[-1][:200])
            if states and all(s == FINISHED for s in states.values()) and len(states) == world:
                value = self.group.members[0].handle.result.remote()
                return _Outcome("finished", value=ray.get(value))
            if states and all(s in (STOPPED, FINISHED) for s in states.values()) and stop_sent:
                self._event(f"stopped at step {self._last_step} to grow to {stop_sent} worker(s)")
                return _Outcome("grow", grow_to=stop_sent)
            if newest >= 0 and stalled(last_progress, time.monotonic(), self.failure.heartbeat_timeout_s):
                return self._teardown([], f"no step for {self.failure.heartbeat_timeout_s:.0f} s")
            if stop_sent is None and time.monotonic() > next_grow_check:
                next_grow_check = time.monotonic() + self.failure.grow_check_interval_s
                grow = self.scaling_policy.growth(world, self.group.can_add())
                if grow.size is not None:
                    self._event(grow.reason + "; stopping at the next checkpoint")
                    self.group.call("request_stop")
                    stop_sent = grow.size

    def _teardown(self, lost: List[Member], reason: str) -> _Outcome:
        """Stop every survivor's training; one whose training does not end is frozen: lost too."""
        self._failed_at = time.monotonic()
        lost_ids = {m.index for m in lost}
        alive = [m for m in self.group.members if m.index not in lost_ids]
        for m in alive:
            m.handle.abort.remote()
        grace = self.failure.collective_timeout_s + 5.0
        refs = {m.index: m.handle.wait_idle.remote(grace) for m in alive}
        for m in alive:
            try:
                if not ray.get(refs[m.index], timeout=grace + 10.0):
                    lost.append(m)  # frozen: its training never came back
            except (ray.exceptions.RayError, TimeoutError):
                lost.append(m)
        return _Outcome("failed", lost=lost, reason=reason)

    # ---- news for the user -------------------------------------------------------------------
    def _forward(self, news: Dict[int, Any]) -> None:
        for n in news.values():
            if not isinstance(n, dict):
                continue
            self._last_step = max(self._last_step, n["step"])
            for rec in n["records"]:
                if "system_metrics" in rec:  # a node's sample, not a training record
                    if self._on_record:
                        self._on_record(rec)
                    continue
                rec.setdefault("world_size", len(self.group.members))
                self.result.records.append(rec)
                if self._on_record:
                    self._on_record(rec)

    def _note_recovery(self, step: int) -> None:
        """The first step after a failure: how long training stood still, as an event and a
        metric (recovery_s at that step)."""
        if self._failed_at is None:
            return
        seconds, self._failed_at = time.monotonic() - self._failed_at, None
        self._event(f"recovered: step {step} done {seconds:.1f} s after the failure was detected")
        rec = {"step": step, "recovery_s": round(seconds, 3), "world_size": len(self.group.members)}
        self.result.records.append(rec)
        if self._on_record:
            self._on_record(rec)

    def _event(self, msg: str) -> None:
        self.result.events.append(msg)
        log.info(msg)
        if self._on_event:
            self._on_event(msg)
