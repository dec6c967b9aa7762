"""The worker actors of a run: placing them, asking them for news, killing them.

Thin on purpose: Ray places the actors, detects their deaths and kills them; the controller
decides what to do with that.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

import ray

from hybrid_ray.config.cluster import ScalingConfig
from .worker import Worker


@dataclass
class Member:
    """One worker actor and what it told us about itself."""

    handle: Any
    index: int  # creation order, stable across generations (names "worker 3" in events)
    info: Dict[str, Any] = field(default_factory=dict)
    acked: int = 0  # sequence number of the newest record received from it (Worker.poll)

    def take_news(self, reply: Any) -> Any:
        """A poll reply with its records as plain dicts, only those not received before; the
        acknowledgement goes out with the next poll. Errors pass through."""
        if not isinstance(reply, dict):
            return reply
        fresh = [(seq, rec) for seq, rec in reply["records"] if seq > self.acked]
        if fresh:
            self.acked = fresh[-1][0]
        return dict(reply, records=[rec for _, rec in fresh])


class WorkerGroup:
    def __init__(self, scaling: ScalingConfig, name: str = "run"):
        self.scaling, self.name = scaling, name
        self.resources = scaling.worker_resources()
        self.members: List[Member] = []
        self._created = 0
        self._actor_cls = ray.remote(Worker)

    # ---- room in the cluster -----------------------------------------------------------
    def can_add(self) -> int:
        """How many more workers the cluster's free resources could hold now (cluster-wide)."""
        free = ray.available_resources()
        fits = [math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in self.resources.items() if v > 0]
        return max(0, min(fits)) if fits else 0

    # ---- membership --------------------------------------------------------------------
    def add(self, count: int, timeout_s: float) -> List[Member]:
        """Start `count` actors; keep those placed and answering within timeout_s."""
        res = dict(self.resources)
        opts = dict(num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0), resources=res or None,
                    max_restarts=0, max_concurrency=4,
                    scheduling_strategy="SPREAD" if self.scaling.placement_strategy == "SPREAD" else "DEFAULT")
        fresh = []
        for _ in range(count):
            # Named so that `ray list actors` (and an operator's ray.get_actor) tells them apart.
            actor = self._actor_cls.options(name=f"hybrid_ray:{self.name}:worker{self._created}",
                                            **opts).remote()
            fresh.append(Member(actor, self._created))
            self._created += 1
        refs = {m.handle.info.remote(): m for m in fresh}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        placed = []
        for ref, m in refs.items():
            if ref in ready:
                try:
                    m.info = ray.get(ref)
                    placed.append(m)
                    continue
                except ray.exceptions.RayError:
                    pass
            ray.kill(m.handle, no_restart=True)  # never placed (no room) or died on start
        self.members.extend(placed)
        return placed

    def remove(self, members: List[Member]) -> None:
        for m in members:
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        gone = {id(m) for m in members}
        self.members = [m for m in self.members if id(m) not in gone]

    def shutdown(self) -> None:
        self.remove(list(self.members))

    # ---- talking to the workers ----------------------------------------------------------
    def call(self, method: str, *args, timeout_s: float = 30.0) -> Dict[int, Any]:
        """Call a method on every member. member index -> result, or the exception it raised
        (RayActorError when the actor is dead, GetTimeoutError when it did not answer)."""
        return _collect({m.index: getattr(m.handle, method).remote(*args) for m in self.members},
                        timeout_s)

    def poll(self, timeout_s: float) -> Dict[int, Any]:
        """Every member's news (Worker.poll), as in `call`; a record whose reply timed out is
        delivered by a later poll, none twice."""
        news = _collect({m.index: m.handle.poll.remote(m.acked) for m in self.members}, timeout_s)
        return {m.index: m.take_news(news[m.index]) for m in self.members}

    def start(self, fn: Any, specs: Dict[int, Dict[str, Any]]) -> Dict[int, Any]:
        """Start every member's training with its own spec; results as in `call`."""
        fn_ref = ray.put(fn)
        return _collect({m.index: m.handle.start.remote(fn_ref, specs[m.index]) for m in self.members},
                        30.0)


def _collect(refs: Dict[int, Any], timeout_s: float) -> Dict[int, Any]:
    """Wait for each reply within one shared deadline; an error stands in for a missing reply."""
    out: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    for index, ref in refs.items():
        try:
            out[index] = ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            out[index] = exc
    return out
