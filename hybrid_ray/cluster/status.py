"""What the driver knows about its workers: their states, one poll's news, the group's members.

Plain data without Ray, so the controller's decisions (policy.py) and the controller itself are
tested with a dummy group and no cluster.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

# A worker's training, as Worker.poll reports it.
IDLE, RUNNING, FINISHED, STOPPED, FAILED = "idle", "running", "finished", "stopped", "failed"


@dataclass(frozen=True)
class WorkerNews:
    """One worker's answer to a poll: its training's state, newest step, error, new records."""

    state: str
    step: int = -1
    error: Optional[str] = None
    records: Tuple[Any, ...] = ()  # hybrid_ray.cluster.records.Record, new since the last poll


@dataclass
class Member:
    """One worker actor and what it told us about itself."""

    handle: Any  # the actor (opaque here; group.py talks to it)
    index: int  # creation order, stable across generations (names "worker 3" in events)
    info: Dict[str, Any] = field(default_factory=dict)
    acked: int = 0  # sequence number of the newest record received from it (Worker.poll)
    replica: int = -1  # the model replica (placement group) it belongs to; -1: a replica of its own
    spare: bool = False  # started ahead as a warm spare (group.keep_spares) before it joined

    def __post_init__(self) -> None:
        if self.replica < 0:
            self.replica = -1 - self.index  # never another member's

    def take_news(self, reply: Any) -> Any:
        """A poll reply (Worker.poll's dict) as WorkerNews with only the records not received
        before; the acknowledgement goes out with the next poll. Errors pass through."""
        if not isinstance(reply, dict):
            return reply
        fresh = [(seq, rec) for seq, rec in reply["records"] if seq > self.acked]
        if fresh:
            self.acked = fresh[-1][0]
        return WorkerNews(reply["state"], reply["step"], reply["error"], tuple(rec for _, rec in fresh))


def replica_mates(members: List[Member], lost: List[Member]) -> List[Member]:
    """The members that share a model replica with a lost one: useless without it."""
    hit, gone = {m.replica for m in lost}, {id(m) for m in lost}
    return [m for m in members if m.replica in hit and id(m) not in gone]


@dataclass(frozen=True)
class PollStatus:
    """One poll of the whole group: who answered what, who is gone.

    news: member index -> WorkerNews of those that answered; lost: members whose actor is dead
    (its process exited, it was killed, its node went); the rest did not answer in time and are
    judged at a later poll.
    """

    world_size: int
    news: Dict[int, WorkerNews] = field(default_factory=dict)
    lost: Tuple[Member, ...] = ()

    @property
    def newest_step(self) -> int:
        return max((n.step for n in self.news.values()), default=-1)

    def states(self) -> List[str]:
        return [n.state for n in self.news.values()]

    def records(self) -> List[Any]:
        return [rec for n in self.news.values() for rec in n.records]
