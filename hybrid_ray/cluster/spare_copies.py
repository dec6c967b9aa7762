"""Warm spares that hold a lone worker's newest replica copy.

A group of one has no buddy: with `fault_tolerance.replicas` its worker only copies its state to
its own host memory, which dies with it. When warm spares stand by, the driver tells the lone
worker who they are (Worker.set_spares) and a thread of the worker pushes each newer committed
copy to every spare (Worker.hold_copy), one push at a time; the spare that replaces the worker
then recovers that step from its own memory. The worker pushes rather than the driver pulling
so that the copy the spares hold trails the worker by one push, not by a poll interval. A push
cut short by the worker's death fails on the spare, which keeps the copy it had.

A single spare on the worker's node does better than pushes: after the first push it opens
shared slots (Worker.open_slots) and the worker's copies land in them directly from then on
(engine/replicas/slots.py), so the spare holds each step as soon as its copy is done.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, List

from hybrid_ray.engine.replicas import handoff

log = logging.getLogger("hybrid_ray")


class SparePusher:
    """The worker's side: the spares to feed, and the thread that feeds them."""

    def __init__(self, interval_s: float = 0.05, timeout_s: float = 300.0) -> None:
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._spares: List[Any] = []
        self._sent = -1  # the newest step every current spare took
        self._lock = threading.Lock()
        self._thread: Any = None
        self._slots_for: Any = None  # (spare, spec) the slots were asked of: asked once

    def set_spares(self, handles: List[Any]) -> None:
        """Feed these spares from now on (none: stop feeding); a new set starts from nothing."""
        with self._lock:
            self._spares, self._sent, self._slots_for = list(handles), -1, None
        handoff.detach_slots()
        handoff.want_copies(bool(handles))
        if handles and self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="hybrid-ray-spare-copies")
            self._thread.start()

    def _loop(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.interval_s):
            with self._lock:
                spares, sent = list(self._spares), self._sent
            if not spares or handoff.newest_step() <= sent:
                continue
            try:
                step = self._push(spares, sent)
            except Exception as e:  # noqa: BLE001 - a spare that went is replaced by the driver
                log.warning("a warm spare did not take this worker's replica copy: %s", str(e)[:200])
                continue
            with self._lock:
                if self._spares == spares:
                    self._sent = max(self._sent, step)

    def _push(self, spares: List[Any], after: int) -> int:
        import ray
        start = time.monotonic()
        with handoff.exported(after) as copy:
            if copy is None:
                return after
            step, spec = copy["step"], handoff.slot_spec(copy)
            # .remote() serialises its argument into the object store before it returns: the
            # snapshot's buffers can go back to the training thread's copies right after.
            replies = [s.hold_copy.remote(copy) for s in spares]
        sent = time.monotonic()
        ray.get(replies, timeout=self.timeout_s)
        log.info("step %d's replica copy went to %d warm spare(s): sent in %.2f s, held after %.2f s more",
                 step, len(spares), sent - start, time.monotonic() - sent)
        self._share_slots(spares, spec)
        return step

    def _share_slots(self, spares: List[Any], spec: dict) -> None:
        """One spare on this node: the copies after this one go into slots it shares with this
        process (asked once per spare and layout; a spare elsewhere answers None)."""
        if len(spares) != 1 or self._slots_for == (spares[0], spec):
            return
        import ray
        self._slots_for = (spares[0], spec)
        try:
            path = ray.get(spares[0].open_slots.remote(spec, ray.get_runtime_context().get_node_id()),
                           timeout=self.timeout_s)
            if path is None:
                return
            with self._lock:  # not if the spares changed meanwhile (set_spares detaches)
                if self._spares == spares:
                    handoff.attach_slots(path, spec)
                    log.info("replica copies go into slots shared with the warm spare from now on (%s)", path)
        except Exception as e:  # noqa: BLE001 - the pushes go on instead
            log.warning("shared replica slots with the warm spare failed, copies keep being pushed: %s",
                        str(e)[:200])
