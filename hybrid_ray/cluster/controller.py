"""The elastic driver: an explicit state machine over generations of a worker group.

    Initializing -> Scheduling -> Running -> Finished
                        ^            |--> (worker lost / failed / stalled) Recovering -> Scheduling
                        |            |--> (room to grow, at a checkpoint boundary) Resizing -> Scheduling
                        |____________|
    Initializing without room, Scheduling below min_workers, Recovering beyond max_failures -> Errored

Each state is a small dataclass; `_step(state)` carries it out and returns the next one. What a
poll of the running group means is decided by pure functions (policy.py), and the group is
injected (group.py's WorkerGroup on Ray, a dummy in tests), so nothing here imports Ray.

Every (re)formation is a new generation: the surviving actors stay (their processes are not
restarted), a fresh process group is formed at the new size, and the training function runs
again on every worker, resuming from the newest committed checkpoint (or, with the engine's
buddy replicas, from the state the survivors hold in memory).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from hybrid_ray.config.cluster import FailureConfig, ScalingConfig

from .policy import Decision, FailurePolicy, ScalingPolicy, Watch, judge, rank_order
from .records import Event, Metrics, Record
from .status import Member, PollStatus, replica_mates

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
    records: List[Metrics] = field(default_factory=list)  # every Metrics record, in arrival order
    events: List[str] = field(default_factory=list)
    generations: int = 0
    failures: int = 0
    world_sizes: List[int] = field(default_factory=list)


# ---- the states ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Initializing:
    """Waiting for room for the first group."""


@dataclass(frozen=True)
class Scheduling:
    """Bring the group to `size` members and start a generation on it."""

    size: int


@dataclass(frozen=True)
class Running:
    """A generation of `world_size` workers is training; each step is one poll."""

    world_size: int


@dataclass(frozen=True)
class Recovering:
    """The generation ended badly: `lost` members are gone (or frozen), for `reason`."""

    lost: Tuple[Member, ...]
    reason: str


@dataclass(frozen=True)
class Resizing:
    """Every worker stopped at a checkpoint to re-form at `size`."""

    size: int


@dataclass(frozen=True)
class Finished:
    value: Any


@dataclass(frozen=True)
class Errored:
    message: str


State = Union[Initializing, Scheduling, Running, Recovering, Resizing, Finished, Errored]
TERMINAL = (Finished, Errored)


class Controller:
    """Runs `fn` on the group's workers until it finishes everywhere, surviving losses.

    group: the worker group (group.WorkerGroup on Ray). clock/sleep: injectable so that tests
    with a dummy group run in simulated time.
    """

    def __init__(self, fn: Callable, scaling: ScalingConfig, failure: FailureConfig,
                 storage_path: str, run_name: str, group: Any,
                 on_record: Optional[Callable[[Record], None]] = None,
                 on_event: Optional[Callable[[str], None]] = None,
                 node_metrics_interval_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.fn, self.scaling, self.failure, self.group = fn, scaling, failure, group
        self.node_metrics_interval_s = node_metrics_interval_s
        self.storage_path, self.run_name = storage_path, run_name
        self.scaling_policy, self.failure_policy = ScalingPolicy(scaling), FailurePolicy(failure)
        self.clock, self.sleep = clock, sleep
        self.result = Result(None)
        self.state: State = Initializing()
        self._on_record, self._on_event = on_record, on_event
        self._last_step = -1  # newest step any worker reported, over all generations
        self._failed_at: Optional[float] = None  # when the newest failure was detected
        self._directive: Optional[dict] = None  # newest send_directive(); new groups start with it
        self._watch: Optional[Watch] = None

    # ---- the state machine ----------------------------------------------------------------
    def run(self) -> Result:
        try:
            while not isinstance(self.state, TERMINAL):
                self.state = self._step(self.state)
        finally:
            self.group.shutdown()
        if isinstance(self.state, Errored):
            raise TrainingFailedError(self.state.message)
        self.result.value = self.state.value
        return self.result

    def _step(self, state: State) -> State:
        handler = {Initializing: self._initialize, Scheduling: self._schedule, Running: self._run,
                   Recovering: self._recover, Resizing: self._resize}[type(state)]
        return handler(state)

    def _initialize(self, state: Initializing) -> State:
        decision = self._wait_for(lambda: self.scaling_policy.initial(self.group.can_add()))
        if decision.size is None:
            return Errored(f"cannot start: {decision.reason} after {self.failure.start_timeout_s:.0f} s")
        self._event(decision.reason)
        return Scheduling(decision.size)

    def _schedule(self, state: Scheduling) -> State:
        """Bring the group to the size (add new actors; shrink by dropping the newest), then
        form a generation on it."""
        missing = state.size - len(self.group.members)
        if missing > 0:
            placed = self.group.add(missing, self.failure.start_timeout_s)
            if len(self.group.members) < self.scaling.min_workers:
                return Errored(f"only {len(self.group.members)} worker(s) could be placed, min_workers "
                               f"is {self.scaling.min_workers}; checkpoints in {self.storage_path} are intact")
            if len(placed) < missing:
                self._event(f"{len(placed)} of {missing} new worker(s) placed; going on with "
                            f"{len(self.group.members)}")
            warm = sum(m.spare for m in placed)
            if warm:
                self._event(f"{warm} warm spare(s) joined")
        elif missing < 0:
            self.group.remove(self.group.members[state.size:])
        return self._start_generation()

    def _start_generation(self) -> State:
        self.group.members[:] = rank_order(self.group.members, self.scaling.replica_size)
        members = self.group.members
        world, generation = len(members), self.result.generations
        self.result.world_sizes.append(world)
        self.result.generations += 1
        port = self.group.rendezvous_port(members[0])
        if port is None:
            return Recovering((members[0],), "worker lost before the group formed")
        specs = {m.index: dict(rank=r, world_size=world, master_addr=members[0].info["ip"],
                               master_port=port, generation=generation, use_gpu=self.scaling.use_gpu,
                               threads=int(self.group.resources.get("CPU", 1)) or 1,
                               collective_timeout_s=self.failure.collective_timeout_s,
                               rendezvous_timeout_s=self.failure.start_timeout_s,
                               storage_path=self.storage_path, run_name=self.run_name,
                               directive=self._directive)
                 for r, m in enumerate(members)}
        dead = self.group.start(self.fn, specs, self.failure.start_timeout_s)
        if dead:
            return self._teardown(dead, "worker lost while starting")
        self._monitor_nodes()
        self.group.keep_spares(self.fn)  # after the group: its members are placed first
        now = self.clock()
        self._watch = Watch(world, last_progress=now, next_grow_check=now + self.failure.grow_check_interval_s)
        return Running(world)

    def _run(self, state: Running) -> State:
        """One poll of the running generation and its verdict."""
        self.sleep(self.failure.poll_interval_s)
        status = self.group.poll(timeout_s=max(5.0, self.failure.poll_interval_s * 4))
        self._forward(status)
        self.group.feed_spares(status)
        now, watch = self.clock(), self._watch
        if not status.lost and watch.observe(status, now):
            self._note_recovery(watch.newest)
        verdict = judge(status, watch, now, self.failure.heartbeat_timeout_s)
        if verdict.kind == "finished":
            value = self.group.result(self.group.members[0])
            at = f"at step {self._last_step}" if self._last_step >= 0 else "with no step reported"
            self._event(f"finished {at} with {len(self.group.members)} worker(s)")
            return Finished(value)
        if verdict.kind == "resize":
            self._event(f"stopped at step {self._last_step} to grow to {verdict.size} worker(s)")
            return Resizing(verdict.size)
        if verdict.kind == "failed":
            if verdict.detail:
                log.warning("a worker failed:\n%s", verdict.detail)
            return self._teardown(list(verdict.lost), verdict.reason)
        self._maybe_grow(state.world_size, now)
        return state

    def _maybe_grow(self, world: int, now: float) -> None:
        """Ask the cluster for room now and then; with room, every worker stops at its next
        checkpoint and the group re-forms larger (the verdict `resize`)."""
        if not self._watch.grow_due(now):
            return
        self._watch.next_grow_check = now + self.failure.grow_check_interval_s
        grow = self.scaling_policy.growth(world, self.group.can_add())
        if grow.size is not None:
            self._event(grow.reason + "; stopping at the next checkpoint")
            self.group.request_stop()
            self._watch.grow_to = grow.size

    def _teardown(self, lost: List[Member], reason: str) -> Recovering:
        """Stop every survivor's training; one whose training does not end is frozen: lost too."""
        self._failed_at = self.clock()
        gone = {m.index for m in lost}
        alive = [m for m in self.group.members if m.index not in gone]
        stuck = self.group.stop(alive, self.failure.collective_timeout_s + 5.0)
        return Recovering(tuple(lost) + tuple(stuck), reason)

    def _recover(self, state: Recovering) -> State:
        self.result.failures += 1
        decision = self.failure_policy.may_recover(self.result.failures)
        lost = ", ".join(f"worker {m.index}" for m in state.lost) or "no worker"
        if decision.size is None:
            return Errored(f"{state.reason} ({lost} lost); {decision.reason}; checkpoints in "
                           f"{self.storage_path} are intact")
        # a replica that lost a worker cannot train: its other workers leave with it
        self.group.remove(list(state.lost) + replica_mates(self.group.members, list(state.lost)))
        survivors = len(self.group.members)
        self.sleep(0.5)  # let Ray return the lost workers' resources before counting room
        step = self._wait_for(lambda: self.scaling_policy.after_loss(survivors, self.group.can_add()))
        if step.size is None:
            return Errored(f"{step.reason}; checkpoints in {self.storage_path} are intact")
        self._event(f"{state.reason}: {lost} lost; {step.reason}, resuming (last step seen "
                    f"{self._last_step})")
        return Scheduling(step.size)

    def _resize(self, state: Resizing) -> State:
        return Scheduling(state.size)

    def _wait_for(self, decide: Callable[[], Decision]) -> Decision:
        """`decide()` until it names a size or start_timeout_s has passed (then its last reason)."""
        deadline = self.clock() + self.failure.start_timeout_s
        while True:
            decision = decide()
            if decision.size is not None or self.clock() > deadline:
                return decision
            self.sleep(1.0)

    # ---- talking to the workers ----------------------------------------------------------------
    def send_directive(self, directive: dict) -> None:
        """Hand every worker a directive (e.g. a gradient compression setting); the training
        function decides when the ranks apply it (WorkerContext.agree_on_directive). Workers
        of later groups start with the newest one."""
        self._directive = directive
        for m in list(self.group.members):
            self.group.tell(m, "set_directive", directive)

    def _monitor_nodes(self) -> None:
        """One worker per node samples that node's system metrics (SystemSample records); the
        others stop. Asked again each generation: the sampling worker may have been lost."""
        if not self.node_metrics_interval_s:
            return
        first: Dict[str, Member] = {}
        for m in self.group.members:
            first.setdefault(m.info["node_id"], m)
        for m in self.group.members:
            label = node_label(m.info) if first[m.info["node_id"]] is m else None
            self.group.tell(m, "monitor_node", label, self.node_metrics_interval_s)

    # ---- news for the user -------------------------------------------------------------------
    def _forward(self, status: PollStatus) -> None:
        """Every record to on_record as it came; Metrics also into the Result; a worker's Event
        joins the driver's events (on_event)."""
        self._last_step = max(self._last_step, status.newest_step)
        for rec in status.records():
            if isinstance(rec, Event):  # the run's events, with the driver's own
                self._event(rec.text)
                continue
            if isinstance(rec, Metrics):
                self.result.records.append(rec)
            if self._on_record:
                self._on_record(rec)

    def _note_recovery(self, step: int) -> None:
        """The first step after a failure: how long training stood still, as an event and a
        metric (recovery_s at that step)."""
        if self._failed_at is None:
            return
        seconds, self._failed_at = self.clock() - self._failed_at, None
        self._event(f"recovered: step {step} done {seconds:.1f} s after the failure was detected")
        rec = Metrics({"step": step, "recovery_s": round(seconds, 3)}, len(self.group.members))
        self.result.records.append(rec)
        if self._on_record:
            self._on_record(rec)

    def _event(self, msg: str) -> None:
        self.result.events.append(msg)
        log.info(msg)
        if self._on_event:
            self._on_event(msg)
