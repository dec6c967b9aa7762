"""The elastic controller's state machine with a dummy worker group: no Ray, simulated time.

Each poll advances every healthy worker of the running generation by one step; workers save a
checkpoint every CKPT steps and a new generation resumes from the newest one, as the real
training functions do. Faults are scripted per (generation, member index, step).
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional

import pytest

from hybrid_ray.cluster.controller import Controller, TrainingFailedError
from hybrid_ray.cluster.records import Metrics
from hybrid_ray.cluster.status import FAILED, FINISHED, RUNNING, STOPPED, Member, PollStatus, WorkerNews
from hybrid_ray.config.cluster import FailureConfig, ScalingConfig

STEPS, CKPT = 12, 4
FAST = dict(heartbeat_timeout_s=30.0, collective_timeout_s=10.0, start_timeout_s=5.0,
            poll_interval_s=0.25, grow_check_interval_s=2.0)


class Clock:
    """Simulated time: sleeping advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Worker:
    def __init__(self) -> None:
        self.state, self.step, self.error = "idle", -1, None
        self.frozen = self.dead = False
        self.records: List[Any] = []


class DummyGroup:
    """The calls the controller makes on a worker group, over simulated workers.

    room: how many workers the cluster can hold (can be changed while the run goes on).
    faults: {(generation, member index, step): "kill" | "freeze" | "raise"}.
    """

    def __init__(self, room: int, faults: Optional[Dict[tuple, str]] = None):
        self.room, self.faults = room, dict(faults or {})
        self.resources = {"CPU": 1.0}
        self.members: List[Member] = []
        self.workers: Dict[int, Worker] = {}
        self.checkpoint = 0  # newest committed step
        self.generation = -1
        self.stop_requested = False
        self.told: List[tuple] = []
        self._ids = itertools.count()

    def can_add(self) -> int:
        return max(0, self.room - len(self.members))

    def add(self, count: int, timeout_s: float) -> List[Member]:
        placed = [Member(None, next(self._ids), {"ip": "127.0.0.1", "node_id": "node0"})
                  for _ in range(min(count, self.can_add()))]
        for m in placed:
            self.workers[m.index] = Worker()
        self.members.extend(placed)
        return placed

    def keep_spares(self, fn: Any) -> None:
        self.spares_asked = getattr(self, "spares_asked", 0) + 1

    def feed_spares(self, status: Any) -> None:
        pass

    def remove(self, members: List[Member]) -> None:
        gone = {m.index for m in members}
        self.members = [m for m in self.members if m.index not in gone]

    def shutdown(self) -> None:
        self.remove(list(self.members))

    def rendezvous_port(self, member: Member) -> Optional[int]:
        return None if self.workers[member.index].dead else 29500

    def start(self, fn: Any, specs: Dict[int, dict], timeout_s: float = 60.0) -> List[Member]:
        self.generation = next(iter(specs.values()))["generation"]
        self.stop_requested = False
        for m in self.members:
            w = self.workers[m.index]
            w.state, w.step, w.error = RUNNING if self.checkpoint < STEPS else FINISHED, self.checkpoint, None
        return [m for m in self.members if self.workers[m.index].dead]

    def _advance(self, m: Member, rank: int) -> None:
        w = self.workers[m.index]
        if w.state != RUNNING or w.frozen or w.dead:
            return
        fault = self.faults.pop((self.generation, m.index, w.step + 1), None)
        if fault == "kill":
            w.dead = True
            return
        if fault == "freeze":
            w.frozen = True
            return
        if fault == "raise":
            w.state, w.error = FAILED, "Traceback (most recent call last):\nValueError: boom"
            return
        w.step += 1
        if rank == 0:
            w.records.append(Metrics({"step": w.step, "loss": 1.0 / w.step}, len(self.members)))
        if w.step % CKPT == 0:
            self.checkpoint = max(self.checkpoint, w.step)
            if self.stop_requested:
                w.state = STOPPED
        if w.step == STEPS:
            w.state = FINISHED

    def poll(self, timeout_s: float) -> PollStatus:
        # A frozen rank holds up everyone's next collective: nobody steps past it.
        if not any(self.workers[m.index].frozen for m in self.members):
            for rank, m in enumerate(self.members):
                self._advance(m, rank)
        news, lost = {}, []
        for m in self.members:
            w = self.workers[m.index]
            if w.dead:
                lost.append(m)
                continue
            news[m.index] = WorkerNews(w.state, w.step, w.error, tuple(w.records))
            w.records = []
        return PollStatus(len(self.members), news, tuple(lost))

    def tell(self, member: Member, method: str, *args: Any) -> None:
        self.told.append((member.index, method, args))

    def request_stop(self) -> None:
        self.stop_requested = True

    def result(self, member: Member) -> Any:
        return f"done by worker {member.index}"

    def stop(self, members: List[Member], grace_s: float) -> List[Member]:
        stuck = [m for m in members if self.workers[m.index].frozen or self.workers[m.index].dead]
        for m in members:
            if m not in stuck:
                self.workers[m.index].state = STOPPED
        return stuck


def controller(group: DummyGroup, min_workers=2, max_workers=2, max_failures=2, **failure):
    clock = Clock()
    c = Controller(lambda ctx: None, ScalingConfig(min_workers=min_workers, max_workers=max_workers),
                   FailureConfig(max_failures=max_failures, **{**FAST, **failure}), "/ckpts", "run",
                   group, clock=clock, sleep=clock.sleep)
    seen: List[str] = []
    step = c._step

    def traced(state):
        if not seen or seen[-1] != type(state).__name__:
            seen.append(type(state).__name__)
        return step(state)

    c._step = traced
    return c, seen, clock


def test_an_undisturbed_run_finishes() -> None:
    c, seen, _ = controller(DummyGroup(room=2))
    result = c.run()
    assert seen == ["Initializing", "Scheduling", "Running"] and type(c.state).__name__ == "Finished"
    assert result.value == "done by worker 0" and result.failures == 0 and result.world_sizes == [2]
    assert [r["step"] for r in result.records] == list(range(1, STEPS + 1))
    assert result.events == ["starting with 2 worker(s)", f"finished at step {STEPS} with 2 worker(s)"]


def test_a_lost_worker_is_replaced_and_training_resumes_from_the_checkpoint() -> None:
    group = DummyGroup(room=2, faults={(0, 1, 6): "kill"})
    c, seen, _ = controller(group)
    result = c.run()
    assert seen == ["Initializing", "Scheduling", "Running", "Recovering", "Scheduling", "Running"]
    assert result.failures == 1 and result.world_sizes == [2, 2] and result.generations == 2
    assert any(e.startswith("worker lost: worker 1 lost; re-forming at 2 worker(s) (1 kept, 1 new)")
               for e in result.events), result.events
    steps = [r["step"] for r in result.records if "loss" in r]
    assert steps == list(range(1, 7)) + list(range(CKPT + 1, STEPS + 1))  # 5..12 redone from 4
    recovery = [r for r in result.records if "recovery_s" in r]
    assert len(recovery) == 1 and recovery[0]["step"] == CKPT + 1 and recovery[0]["recovery_s"] > 0
    assert [m.index for m in group.members] == []  # shut down at the end


def test_a_frozen_worker_stalls_the_group_and_is_killed_as_lost() -> None:
    group = DummyGroup(room=2, faults={(0, 0, 7): "freeze"})
    c, seen, clock = controller(group, heartbeat_timeout_s=30.0)
    result = c.run()
    assert result.failures == 1 and result.world_sizes == [2, 2]
    stalled = [e for e in result.events if e.startswith("no step for 30 s")]
    assert stalled and "worker 0 lost" in stalled[0], result.events
    assert clock.now > 30.0  # it waited for the heartbeat timeout, in simulated time


def test_room_to_grow_stops_at_a_checkpoint_and_reforms_larger() -> None:
    group = DummyGroup(room=1)
    c, seen, clock = controller(group, min_workers=1, max_workers=2, grow_check_interval_s=0.5)
    poll = group.poll

    def poll_then_make_room(timeout_s: float) -> PollStatus:
        if clock.now > 0.3:  # a node joins soon after the start (each poll is 0.25 s, one step)
            group.room = 2
        return poll(timeout_s)

    group.poll = poll_then_make_room
    result = c.run()
    assert seen == ["Initializing", "Scheduling", "Running", "Resizing", "Scheduling", "Running"]
    assert result.world_sizes == [1, 2] and result.failures == 0
    assert "cluster has room: growing from 1 to 2 worker(s); stopping at the next checkpoint" in result.events
    assert any(e.startswith("stopped at step 4 to grow to 2") for e in result.events), result.events


def test_without_a_replacement_the_group_shrinks_to_the_survivors() -> None:
    group = DummyGroup(room=2, faults={(0, 1, 3): "kill"})
    c, _, _ = controller(group, min_workers=1, max_workers=2)
    recover = c._recover

    def lose_the_room(state):
        group.room = 1  # the lost worker's slot is taken by someone else
        return recover(state)

    c._recover = lose_the_room  # _step dispatches to the instance's handlers
    result = c.run()
    assert result.world_sizes == [2, 1] and result.value == "done by worker 0"


def test_a_failing_training_tears_the_group_down_and_counts() -> None:
    group = DummyGroup(room=2, faults={(0, 1, 2): "raise"})
    c, _, _ = controller(group)
    result = c.run()
    assert result.failures == 1 and result.world_sizes == [2, 2]
    assert any(e.startswith("worker failed: ValueError: boom: no worker lost") for e in result.events), \
        result.events


def test_more_failures_than_allowed_end_in_a_clear_error() -> None:
    group = DummyGroup(room=2, faults={(0, 1, 5): "kill", (1, 2, 6): "kill"})
    c, seen, _ = controller(group, max_failures=1)
    with pytest.raises(TrainingFailedError, match=r"worker lost \(worker 2 lost\); 2 failures exceed "
                                                  r"failure.max_failures=1; checkpoints in /ckpts are intact"):
        c.run()
    assert seen[-1] == "Recovering" and type(c.state).__name__ == "Errored"
    assert group.members == []


def test_no_room_to_start_is_an_error_after_the_start_timeout() -> None:
    c, _, clock = controller(DummyGroup(room=1), min_workers=2, max_workers=2, start_timeout_s=5.0)
    with pytest.raises(TrainingFailedError, match=r"cannot start: waiting for room: 1 worker\(s\) fit, "
                                                  r"min_workers is 2 after 5 s"):
        c.run()
    assert clock.now >= 5.0


def test_directives_reach_every_member_and_new_groups_start_with_the_newest() -> None:
    group = DummyGroup(room=2, faults={(0, 1, 3): "kill"})
    c, _, _ = controller(group)
    start, specs_seen = group.start, []

    def start_and_direct(fn, specs, timeout_s):
        specs_seen.append(specs)
        if group.generation < 0:  # the driver decides while the first group starts
            c.send_directive({"id": 1, "setting": {"type": "bf16"}, "reason": "test"})
        return start(fn, specs, timeout_s)

    group.start = start_and_direct
    c.run()
    assert [m for m, method, _ in group.told if method == "set_directive"] == [0, 1]
    assert specs_seen[0][0]["directive"] is None
    assert all(s["directive"]["id"] == 1 for s in specs_seen[1].values())
