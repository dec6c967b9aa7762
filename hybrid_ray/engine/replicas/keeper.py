"""What this process keeps between groups: its own snapshots and its buddy's, by version.

The keeper outlives the engine that filled it: a Ray worker's process survives a lost peer, its
engine does not (the group it used is gone), and the next group's engine recovers from what the
survivors' keepers hold. It is a process-wide object for that reason, and holds host tensors
only, never the engine or a process group.

Versions. A version is the optimizer step a snapshot was taken after. Each rank keeps its own
snapshots and the ones its buddy sent, until a newer version is committed (every rank has sent
and received it): then the older ones go. So at any moment the keepers together hold the last
committed version of every rank, and possibly the next one, and `plan` picks the newest
version that the survivors hold for every rank of the old group.

Replay mode keeps no copy of the rank's own shard: `own` holds the engine's live tensors by
reference, under the step they are at (dropped while the optimizer writes into them). `held`
is one copy of the buddy's shard, and `pending` the buddy's next reduced gradient, which
`advance` applies to it (in the background, or at a recovery that needs that step).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .snapshot import Snapshot


class Keeper:
    """Snapshots by version: `own` (this rank's) and `held` (its buddy's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.own: Dict[int, Snapshot] = {}
        self.held: Dict[int, Snapshot] = {}
        self.committed = -1
        self.disk_step = -1  # newest checkpoint step this run saved or loaded (so memory is not older)
        self.run: Optional[str] = None
        self._token = 0  # the ring whose updates count (begin)
        self._spare: Dict[str, Snapshot] = {}  # "own"/"held": a dropped snapshot, for its buffers
        self.pending: Optional[Any] = None  # replay: the buddy's next step (replay.Pending)
        self._leased: set = set()  # ids of own snapshots being copied out (lease_newest_own)
        # A lone worker's: the warm spare's shared slots its copies now go to (slots.SlotWriter),
        # and whether spares want its copies at all (replay mode makes none otherwise).
        self.slot_writer: Optional[Any] = None
        self.copies_wanted = False

    def swap_slot_writer(self, writer: Optional[Any]) -> Optional[Any]:
        """Send this process's copies to `writer`'s slots from the next one on (None: to its own
        memory again); the writer replaced, for the caller to close."""
        with self._lock:
            old, self.slot_writer = self.slot_writer, writer
            return old

    def start(self, run: Optional[str]) -> None:
        """A new group of this run begins snapshotting; snapshots of another run are dropped."""
        with self._lock:
            self._switch(run)

    def saw_disk(self, run: Optional[str], step: int) -> None:
        """The run saved or loaded a checkpoint of `step`."""
        with self._lock:
            self._switch(run)
            self.disk_step = max(self.disk_step, step)

    def _switch(self, run: Optional[str]) -> None:
        if run != self.run:
            self.own.clear()
            self.held.clear()
            self._spare.clear()
            self.pending = None
            self.committed, self.disk_step = -1, -1
        self.run = run

    def begin(self) -> int:
        """A new engine's ring starts: a token for its updates. Updates under an older token
        (an exchange of a group that has since broken, still blocked or finishing late) are
        ignored, so a recovery never waits for them and never sees them land halfway."""
        with self._lock:
            self._token += 1
            return self._token

    def put_own(self, snap: Snapshot, token: int) -> None:
        self._put(self.own, snap, token)

    def put_held(self, snap: Snapshot, token: int) -> None:
        self._put(self.held, snap, token)

    def _put(self, store: Dict[int, Snapshot], snap: Snapshot, token: int) -> None:
        with self._lock:
            if token == self._token:
                snap.token = token
                store[snap.step] = snap

    def set_live(self, snap: Optional[Snapshot], token: int) -> None:
        """Replay: this rank's live state by reference (None: being updated, not a version),
        replacing every other own entry (they are the same tensors, or an older ring's)."""
        with self._lock:
            if token != self._token:
                return
            self.own.clear()
            if snap is not None:
                snap.token = token
                self.own[snap.step] = snap

    def set_pending(self, pending: Any, token: int) -> None:
        """Replay: the buddy's committed next step, to be applied to `held` by `advance`."""
        with self._lock:
            if token == self._token:
                self.pending = pending

    def advance(self) -> None:
        """Replay: apply the pending step to the held copy. Under the lock, so that a recovery
        never reads a copy halfway through its update; idempotent."""
        with self._lock:
            self._advance()

    def _pending_base(self) -> Optional[Snapshot]:
        """The held copy the pending step applies to, when there is one that can be stepped."""
        pend = self.pending
        base = self.held.get(pend.step - 1) if pend is not None else None
        return base if base is not None and base.stepper is not None else None

    def _advance(self) -> None:
        base, pend = self._pending_base(), self.pending
        self.pending = None
        if base is None:
            return
        base.stepper.apply(pend)
        del self.held[base.step]
        base.step, base.part, base.small = pend.step, pend.part, b""
        self.held[pend.step] = base

    def commit(self, version: int, token: int) -> None:
        """Every rank holds `version` of every shard: older versions, and those of earlier
        rings (the group before a recovery), can go. Their buffers are kept for the next
        snapshot: pinned host memory is slow to allocate."""
        with self._lock:
            if token != self._token:
                return
            self.committed = version
            pend = self.pending
            base = pend.step - 1 if pend is not None and pend.step == version else None
            if base is None:
                self.pending = None
            for name, store in (("own", self.own), ("held", self.held)):
                for v in [v for v, s in store.items() if (v < version and not (name == "held" and v == base))
                          or s.token != token]:
                    gone = store.pop(v)
                    if id(gone) not in self._leased and not gone.borrowed:  # a leased one is being read
                        self._spare[name] = gone

    def rewind(self, step: int) -> None:
        """The run went on from `step` (a recovery or a checkpoint load): versions after it
        belong to a history that was given up and must never be combined with the new one."""
        with self._lock:
            for store in (self.own, self.held):
                for v in [v for v in store if v > step]:
                    del store[v]
            if self.pending is not None and self.pending.step > step:
                self.pending = None

    def _newest_own_copy(self, after: int) -> int:
        """The newest committed version of this rank's own host copy newer than `after` (-1:
        none); replay mode's live entry is not a copy. The caller holds the lock."""
        return max((v for v, s in self.own.items() if after < v <= self.committed and s.full and not s.live),
                   default=-1)

    def lease_newest_own(self, after: int) -> Optional[Snapshot]:
        """This rank's newest committed host copy (copy mode) newer than `after`, kept out of
        buffer reuse until `release`: a warm spare's copy is taken from it (cluster layer)."""
        with self._lock:
            version = self._newest_own_copy(after)
            if version < 0:
                return None
            snap = self.own[version]
            self._leased.add(id(snap))
            return snap

    def release(self, snap: Snapshot) -> None:
        with self._lock:
            self._leased.discard(id(snap))

    def newest_copy(self) -> int:
        """The newest committed version of this rank's own host copy (-1: none)."""
        with self._lock:
            return self._newest_own_copy(-1)

    def keep_copy(self, snap: Snapshot) -> None:
        """A warm spare's: the newest copy of a lone worker's state, held as a buddy holds its
        predecessor's, so that the spare that replaces the worker recovers from it."""
        with self._lock:
            self._switch(snap.run)
            snap.token = self._token
            self.held.clear()
            self.held[snap.step] = snap
            self.committed = max(self.committed, snap.step)

    def recycled(self, store: str) -> Optional[Snapshot]:
        """A snapshot that a newer commit made useless, whose buffers the next one can reuse."""
        with self._lock:
            return self._spare.pop(store, None)

    def summary(self) -> dict:
        """What a recovery needs to know of this process (sent to every new rank). "full": the
        (where, version) whose snapshot has the step's counters and layout, not only its rank part."""
        with self._lock:
            held = {v: (s.rank, s.world) for v, s in self.held.items()}
            base = self._pending_base()
            if base is not None:
                held[self.pending.step] = (base.rank, base.world)  # reachable: advance() on request
            full = [(w, v) for w, store in (("own", self.own), ("held", self.held))
                    for v, s in store.items() if s.full]
            return {"run": self.run, "disk_step": self.disk_step, "full": full,
                    "own": {v: (s.rank, s.world) for v, s in self.own.items()}, "held": held}

    def get(self, where: str, version: int) -> Snapshot:
        with self._lock:
            if where == "held" and version not in self.held and self.pending is not None \
                    and self.pending.step == version:
                self._advance()
            return (self.own if where == "own" else self.held)[version]

    def clear(self) -> None:
        self.start(None)


KEEPER = Keeper()
NOTHING_HELD = "no worker holds replicas of this run"  # plan's reason when memory has nothing: a first start


@dataclass(frozen=True)
class Plan:
    """Where every shard of the old group's version `step` comes from: old rank -> (new rank
    that holds it, "own" or "held"); and which holder has the step's counters and layout."""

    step: int
    world: int
    sources: Dict[int, Tuple[int, str]]
    meta_source: Tuple[int, str] = (0, "own")


def plan(summaries: List[dict], run: Optional[str]) -> Tuple[Optional[Plan], str]:
    """The newest version the survivors hold for every rank of the group that took it, or None
    and why not. Pure: every rank computes the same plan from the same summaries."""
    mine = [s for s in summaries if s.get("run") == run and run is not None]
    if not mine:
        return None, NOTHING_HELD
    offers: Dict[Tuple[int, int], Dict[int, Tuple[int, str]]] = {}  # (version, world) -> old rank -> source
    # Own copies first, on every rank: a rank that holds its own shard loads it without the
    # others (recover._each_holds_its_own), where a buddy's copy would have to be sent.
    for where in ("own", "held"):
        for new_rank, s in enumerate(summaries):
            if s.get("run") != run:
                continue
            for version, (old_rank, world) in s[where].items():
                offers.setdefault((version, world), {}).setdefault(old_rank, (new_rank, where))
    # Who holds each (version, world)'s counters and layout (a replayed copy holds only its
    # rank's part): a version without such a holder is not usable.
    full: Dict[Tuple[int, int], Tuple[int, str]] = {}
    for new_rank, s in enumerate(summaries):
        if s.get("run") == run:
            for where, v in s.get("full", [(w, v) for w in ("own", "held") for v in s[w]]):
                full.setdefault((v, s[where][v][1]), (new_rank, where))
    if not offers:  # the run is known here (a checkpoint was seen) but no copy of it is held
        return None, NOTHING_HELD
    complete = [(v, w) for (v, w), got in offers.items() if set(got) >= set(range(w)) and (v, w) in full]
    disk = max(s["disk_step"] for s in mine)
    if not complete:
        newest = max(v for v, _ in offers) if offers else -1
        missing = sorted(set(range(max(w for _, w in offers))) - set(offers[max(offers)])) if offers else []
        if offers and not missing:
            return None, (f"no survivor holds the counters of step {newest}: the group was cut off "
                          "while committing it")
        return None, (f"the replicas of step {newest} lack rank(s) {missing}: a rank and its buddy "
                      "were lost together")
    version, world = max(complete)
    if version < disk:
        return None, f"the replicas (step {version}) are older than the newest checkpoint (step {disk})"
    return Plan(version, world, {r: offers[(version, world)][r] for r in range(world)},
                full[(version, world)]), "ok"
