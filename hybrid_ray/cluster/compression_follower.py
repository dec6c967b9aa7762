"""The workers' side of the driver's gradient-compression choice (`gradient_compression.type:
auto` on Ray; compression_driver.py is the driver's side).

Every rank: measures the link when the group forms (rank 0 reports it), sums the exposed
communication of each step, and at every logging step agrees with the others on the driver's
newest directive (a collective), so a new setting takes effect at the same step on all ranks.
Rank 0 sends an Interval record (the interval's numbers, the id of the setting in force) with
each logging step.
"""
from __future__ import annotations

from typing import Callable, Optional

from hybrid_ray.config import ConfigError
from hybrid_ray.engine import comm

from .compression_policy import describe
from .records import Interval


class DirectiveFollower:
    def __init__(self, engine, agree: Callable[[], Optional[dict]], say: Callable[[str], None]):
        self.engine, self.agree, self.say = engine, agree, say
        self.applied_id = 0  # 0: the job's own start, dense (type auto reduces densely alone)
        self._comm_s, self._warming = 0.0, False
        self._refused = ""  # why the engine refused directive applied_id ("" : it is in force)

    def probe_link(self, max_seconds: float = 0.2, max_bytes: int = 64 << 20) -> float:
        """Bus bandwidth in bytes/s (collective). Grows the buffer until one all-reduce takes
        about max_seconds, so a slow link is not probed with 64 MB (minutes at 1 MB/s)."""
        nbytes = 256 << 10
        while True:
            bw = comm.probe_bandwidth(self.engine.topology.group, nbytes=nbytes, repeats=2)
            if nbytes * 8 > max_bytes or nbytes / bw >= max_seconds / 8:  # same answer on every rank
                return bw
            nbytes *= 8

    def after_step(self) -> None:
        """After each optimizer step: add its exposed communication to the interval's."""
        stats = self.engine.compression_stats()
        self._comm_s += float(stats.get("comm_wait_s") or 0.0)
        self._warming = self._warming or bool(stats.get("warming"))

    def interval(self, step: int, steps: int, seconds: float) -> Interval:
        """The record of the interval that ended at `step` (rank 0 sends it); starts the next."""
        out = Interval(self.applied_id, steps, seconds / max(steps, 1), self._comm_s / max(steps, 1), step,
                       self._warming, self._refused)
        self._comm_s, self._warming = 0.0, False
        return out

    def sync(self, step: int) -> None:
        """Collective: apply the driver's newest directive if it is not in force yet."""
        directive = self.agree()
        if directive is None or directive["id"] == self.applied_id:
            return
        try:
            self.engine.set_gradient_compression(directive["setting"])
        except ConfigError as e:  # NotSupportedError too: this engine cannot run it (1-bit on SGD)
            # Every rank refuses alike (one config, one engine): the old setting goes on, and the
            # intervals under this id tell the driver why, so that it tries the next one.
            self.applied_id, self._refused = directive["id"], str(e).splitlines()[0][:300]
            self.say(f"step {step}: gradient compression {describe(directive['setting'])} refused here "
                     f"({self._refused}); {describe(self.engine.gradient_compression)} goes on")
            return
        self.applied_id, self._refused = directive["id"], ""
        self.say(f"step {step}: gradient compression now {describe(directive['setting'])} "
                 f"(driver: {directive['reason']})")
