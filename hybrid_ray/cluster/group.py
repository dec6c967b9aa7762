"""The worker actors of a run on Ray: placing them, asking them for news, stopping, killing them.

Thin on purpose: Ray places the actors, detects their deaths and kills them; the controller
decides what to do with that. Everything the controller asks of a group is a method here, so a
dummy group with the same methods runs the controller without a cluster (tests/unit).
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional

import ray

from hybrid_ray.config.cluster import ScalingConfig

from .status import Member, PollStatus, WorkerNews
from .worker import Worker


class WorkerGroup:
    """The members of one run, and the calls the controller makes on them."""

    def __init__(self, scaling: ScalingConfig, name: str = "run"):
        self.scaling, self.name = scaling, name
        self.resources = scaling.worker_resources()
        self.members: List[Member] = []
        self._created = 0
        self._actor_cls = ray.remote(Worker)
        self._placement_groups: Dict[int, Any] = {}  # replica -> its placement group (replica_size > 1)
        self.spares: List[Member] = []  # started and warming or waiting (keep_spares)
        self._warming: Dict[int, Any] = {}  # spare index -> its warm() reply
        self._fed: Any = None  # (lone member, spares) last told to Worker.set_spares

    # ---- room in the cluster -----------------------------------------------------------
    def can_add(self) -> int:
        """How many more workers the cluster could hold now (cluster-wide): its free resources,
        plus the spares, ready or warming, that can join."""
        return self._room() + len(self.spares)

    def _room(self) -> int:
        free = ray.available_resources()
        fits = [math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in self.resources.items() if v > 0]
        return max(0, min(fits)) if fits else 0

    # ---- warm spares -------------------------------------------------------------------
    def keep_spares(self, fn: Any) -> None:
        """Start actors (without waiting) until scaling.spare_workers stand beside the group,
        each warming up with the training function `fn`; no more than the cluster has room for."""
        want = min(self.scaling.spare_workers - len(self.spares), self._room())
        if want <= 0:
            return
        fn_ref = ray.put(fn)
        for _ in range(want):
            m = self._start_replica(1, 0.0)[0]
            self._warming[m.index] = (m.handle.info.remote(), m.handle.warm.remote(fn_ref))
            self.spares.append(m)

    def _ready_spares(self, timeout_s: float = 0.0) -> List[Member]:
        """Spares that answered (info and warm-up done) within timeout_s; one that died is
        dropped. A spare still warming is further along than a new actor would be: worth the wait."""
        pending = [ref for m in self.spares for ref in self._warming[m.index]]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        ready = []
        for m in list(self.spares):
            info_ref, warm_ref = self._warming[m.index]
            done, _ = ray.wait([info_ref, warm_ref], num_returns=2, timeout=0)
            if len(done) < 2:
                continue
            try:
                m.info = ray.get(info_ref)
                ray.get(warm_ref)
                ready.append(m)
            except ray.exceptions.RayError:
                self.spares.remove(m)
                self._warming.pop(m.index, None)
        return ready

    def _take_spares(self, count: int, timeout_s: float) -> List[Member]:
        taken = self._ready_spares(timeout_s if self.spares else 0.0)[:count]
        for m in taken:
            self.spares.remove(m)
            self._warming.pop(m.index, None)
            m.spare = True
        return taken

    # ---- membership --------------------------------------------------------------------
    def add(self, count: int, timeout_s: float) -> List[Member]:
        """Start `count` actors, whole model replicas of `replica_size` (one placement group
        each, packed on one node, so a replica's tensor-parallel traffic stays on the node);
        keep those placed and answering within timeout_s, a replica only whole."""
        size = self.scaling.replica_size
        spares = self._take_spares(count, timeout_s) if size == 1 else []
        if self.members:  # a lone worker lives on: its copy in the spares' memory is not needed
            for m in spares:  # (actor calls run in order: before the spare's start)
                m.handle.drop_slots.remote()
        self.members.extend(spares)
        count -= len(spares)
        fresh: List[Member] = []
        for _ in range(count // size):
            fresh.extend(self._start_replica(size, timeout_s))
        refs = {m.handle.info.remote(): m for m in fresh}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        answered = set()
        for ref, m in refs.items():
            if ref in ready:
                try:
                    m.info = ray.get(ref)
                    answered.add(id(m))
                except ray.exceptions.RayError:
                    pass
        whole = {m.replica for m in fresh} - {m.replica for m in fresh if id(m) not in answered}
        placed = [m for m in fresh if m.replica in whole]
        self.members.extend(placed)
        self.remove([m for m in fresh if m.replica not in whole], listed=False)  # never placed, or died on start
        return spares + placed

    def _start_replica(self, size: int, timeout_s: float) -> List[Member]:
        res = dict(self.resources)
        opts = dict(num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0), resources=res or None,
                    max_restarts=0, max_concurrency=4)
        replica = self._created
        strategies: List[Any] = ["SPREAD" if self.scaling.placement_strategy == "SPREAD" else "DEFAULT"]
        if size > 1:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg = placement_group([dict(self.resources)] * size, strategy="STRICT_PACK",
                                 name=f"hybrid_ray:{self.name}:replica{replica}")
            if not ray.wait([pg.ready()], timeout=timeout_s)[0]:  # no node has room for all of it
                ray.util.remove_placement_group(pg)
                return []
            self._placement_groups[replica] = pg
            strategies = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                          for i in range(size)]
        out = []
        for i in range(size):
            # Named so that `ray list actors` (and an operator's ray.get_actor) tells them apart.
            actor = self._actor_cls.options(name=f"hybrid_ray:{self.name}:worker{self._created}",
                                            scheduling_strategy=strategies[min(i, len(strategies) - 1)],
                                            **opts).remote()
            out.append(Member(actor, self._created, replica=replica))
            self._created += 1
        return out

    def remove(self, members: List[Member], listed: bool = True) -> None:
        for m in members:
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if listed:
            gone = {id(m) for m in members}
            self.members = [m for m in self.members if id(m) not in gone]
        held = {m.replica for m in self.members}
        for replica in [r for r in self._placement_groups if r not in held]:
            ray.util.remove_placement_group(self._placement_groups.pop(replica))

    def shutdown(self) -> None:
        self.remove(list(self.members))
        self.remove(self.spares, listed=False)
        self.spares.clear()

    # ---- one generation ------------------------------------------------------------------
    def feed_spares(self, status: PollStatus) -> None:
        """A lone worker feeds its replica copies to the warm spares itself (spare_copies.py):
        tell it who they are whenever that changes, and a larger group's members that it is over."""
        alone = len(self.members) == 1 and self.spares
        key = (self.members[0].index, tuple(s.index for s in self.spares)) if alone else None
        if key == self._fed:
            return
        self._fed = key
        for m in self.members:
            self.tell(m, "set_spares", [s.handle for s in self.spares] if alone else [])

    def rendezvous_port(self, member: Member) -> Optional[int]:
        """A free TCP port on `member`'s host for the group's rendezvous; None if it is gone."""
        try:
            return ray.get(member.handle.free_port.remote(), timeout=30)
        except ray.exceptions.RayError:
            return None

    def start(self, fn: Any, specs: Dict[int, Dict[str, Any]], timeout_s: float = 60.0) -> List[Member]:
        """Start every member's training with its own spec; the members that failed to start.
        Every member takes the function first, then all launch together (Worker.prepare)."""
        fn_ref = ray.put(fn)
        ready = _collect({m.index: m.handle.prepare.remote(fn_ref, specs[m.index])
                          for m in self.members}, timeout_s)
        failed = [m for m in self.members if isinstance(ready.get(m.index), Exception)]
        if failed:
            return failed
        out = _collect({m.index: m.handle.launch.remote() for m in self.members}, 30.0)
        return [m for m in self.members if isinstance(out.get(m.index), Exception)]

    def poll(self, timeout_s: float) -> PollStatus:
        """Every member's news (Worker.poll): a record whose reply timed out is delivered by a
        later poll, none twice; a member whose actor died is lost."""
        replies = _collect({m.index: m.handle.poll.remote(m.acked) for m in self.members}, timeout_s)
        news = {m.index: m.take_news(replies[m.index]) for m in self.members}
        for m in self.members:  # acknowledge now: a worker flushing its records waits for this
            if isinstance(news[m.index], WorkerNews) and news[m.index].records:
                m.handle.ack.remote(m.acked)
        lost = tuple(m for m in self.members if isinstance(news[m.index], ray.exceptions.RayActorError))
        answered = {i: n for i, n in news.items() if not isinstance(n, Exception)}
        return PollStatus(len(self.members), answered, lost)

    def tell(self, member: Member, method: str, *args: Any) -> None:
        """Fire and forget (a directive, a monitoring order): a lost worker shows up in the
        next poll."""
        getattr(member.handle, method).remote(*args)

    def request_stop(self) -> None:
        """Every member stops at its next checkpoint boundary (to re-form at another size)."""
        _collect({m.index: m.handle.request_stop.remote() for m in self.members}, 30.0)

    def result(self, member: Member) -> Any:
        return ray.get(member.handle.result.remote())

    def stop(self, members: List[Member], grace_s: float) -> List[Member]:
        """Stop these members' training (ending their commit waits too); those whose training
        does not end within grace_s, or that are gone, are returned: frozen or lost."""
        for m in members:
            m.handle.abort.remote()
        refs = {m.index: m.handle.wait_idle.remote(grace_s) for m in members}
        stuck = []
        for m in members:
            try:
                if not ray.get(refs[m.index], timeout=grace_s + 10.0):
                    stuck.append(m)  # frozen: its training never came back
            except (ray.exceptions.RayError, TimeoutError):
                stuck.append(m)
        return stuck


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
