"""The background thread that moves queued items to MLflow, in order, surviving outages.

Training threads only append to an in-memory queue. This thread opens the run (see run.py),
then sends the queue head: consecutive metrics/params/tags/events as one log_batch, artifacts
and the final status one by one. An item leaves the queue only once MLflow acknowledged it.
A transport failure (server down, timeout, 5xx) is warned about once, then retried with
exponential backoff until the server answers; a refusal (4xx: an invalid value, a deleted run)
drops that item with an error, since sending it again would fail the same way.

With a journal (journal.py) every item put is written to disk first, and every item that leaves
the queue, sent or refused, is acknowledged there; staged copies are removed only after that.
"""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import List, Optional

import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from . import ops
from .batch import plan_batch
from .journal import Journal
from .outputs import send_dataset, send_model
from .run import EVENTS_FILE, RunState, artifact_root, open_run

log = logging.getLogger("hybrid_ray.tracking")
_MAX_ERRORS_LOGGED = 5


@dataclass(frozen=True)
class FlushReport:
    """What became of everything the tracker was given (counts of metrics, params, tags, files)."""

    sent: int
    """Acknowledged by MLflow."""
    unsent: int
    """Still queued when close() gave up (the server stayed unreachable)."""
    dropped: int
    """Refused at the call because the buffer was full during an outage."""
    failed: int
    """Refused by MLflow (invalid values, a deleted run)."""
    replayed: int
    """Metric steps logged again after a recovery, kept once (the first time)."""
    spooled_in: Optional[str] = None
    """The spool that keeps the unsent items (RunTracker's spool_dir), if any."""


def transient(exc: BaseException) -> bool:
    """Worth retrying: the server could not be reached or failed on its side."""
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status == 429  # transport errors come wrapped as 500
    return isinstance(exc, (ConnectionError, TimeoutError, requests.RequestException))


class Sender:
    """Owns the queue and the thread; see the module docstring."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, staging_dir: str,
                 max_buffered: int, max_backoff_s: float, journal: Optional[Journal] = None):
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.staging_dir, self.journal = staging_dir, journal
        self.max_buffered, self.max_backoff_s = max_buffered, max_backoff_s
        self.state: Optional[RunState] = None
        self.sent = self.dropped = self.failed = self.replayed = 0
        self._queue: deque = deque()
        self._buffered = 0  # metric values queued, the part bounded by max_buffered
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._closing = self._abort = False
        self._events_dirty = False
        self._warned_full = self._warned_down = False
        self._down_since: Optional[float] = None
        self._errors_logged = 0
        self._taken = 0  # items in the batch being sent
        self._solo = 0   # after a refused batch: send this many items one by one to find the bad one
        self._thread = threading.Thread(target=self._run, name="hybrid_ray-mlflow", daemon=True)
        self._thread.start()

    # ---- the training side -----------------------------------------------------------------
    def put(self, item, replay: bool = False) -> bool:
        """Queue an item; False if a metrics item was refused because the buffer is full.
        replay: an item of an earlier session, read back from the journal (never refused)."""
        metered = isinstance(item, (ops.Metrics, ops.SystemMetrics))
        with self._cond:
            if metered and not replay and self._buffered + item.size > self.max_buffered:
                self.dropped += item.size
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("MLflow buffer full (%d metric values queued): newer metrics are "
                                "dropped until the server at %s takes the backlog",
                                self._buffered, self.tracking_uri)
                return False
            if self.journal is not None and not replay:
                self.journal.append(item)  # under the lock: the journal's order is the queue's
            self._queue.append(item)
            self._buffered += item.size if metered else 0
            self._cond.notify()
        return True

    @property
    def pending(self) -> int:
        with self._cond:
            return sum(item.size for item in self._queue)

    def close(self, timeout_s: float) -> FlushReport:
        """Send what is queued, for at most timeout_s; the report counts what was not."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._wake.set()
        self._thread.join(timeout_s)
        with self._cond:
            self._abort = True
            unsent = sum(item.size for item in self._queue) + int(self._events_dirty)
        if unsent and self.journal is None:  # with a journal the tracker says where they are
            log.warning("MLflow: %d item(s) could not be sent to %s before close() gave up",
                        unsent, self.tracking_uri)
        return FlushReport(self.sent, unsent, self.dropped, self.failed, self.replayed)

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        client: Optional[MlflowClient] = None
        backoff = 0.5
        while self._next_round():
            try:
                if client is None:
                    client = MlflowClient(self.tracking_uri)
                if self.state is None:
                    self.state = open_run(client, self.experiment, self.run_name,
                                          artifact_root(self.tracking_uri))
                self._send_head(client)
                self._back_up()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - nothing may escape into training
                if self.state is not None and not transient(exc):
                    self._refused(exc)
                    continue
                self._went_down(exc)
                self._pause(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def _next_round(self) -> bool:
        """Wait for work; False when the thread should end."""
        with self._cond:
            while not (self._queue or self._events_dirty or self._closing):
                self._cond.wait()
            if self._abort:
                return False
            return bool(self._queue or self._events_dirty)

    def _pause(self, seconds: float) -> None:
        if self._closing:  # close() is waiting: keep trying, often, until its deadline
            time.sleep(min(seconds, 0.5))
        else:
            self._wake.wait(seconds)  # close() cuts a long pause short

    def _send_head(self, client: MlflowClient) -> None:
        state = self.state
        if self._events_dirty:
            self._upload_events(client, state)
        with self._cond:
            # A batch is a prefix of the queue; islice, not a copy: after an outage it is long.
            items = list(itertools.islice(self._queue, 1 if self._solo else 256))
        if not items:
            return
        head = items[0]
        if isinstance(head, ops.Artifact):
            self._send_artifact(client, state, head)
            self._pop(1)
        elif isinstance(head, ops.Model):
            send_model(client, state, head, self._record_model)
            self._pop(1)
        elif isinstance(head, ops.Dataset):
            send_dataset(client, state, head)
            self._pop(1)
        elif isinstance(head, ops.Terminate):
            client.set_terminated(state.run_id, head.status, head.end_time)
            self._pop(1)
        else:
            plan = plan_batch(items, state)
            self._taken = plan.taken
            if plan.metrics or plan.params or plan.tags:
                client.log_batch(state.run_id, metrics=plan.metrics, params=plan.params,
                                 tags=plan.tag_entities, synchronous=True)
            plan.apply(state)
            self.replayed += plan.replayed
            self.sent -= plan.replayed  # _pop counts every value taken; replays were not sent
            self._events_dirty = self._events_dirty or bool(plan.event_lines)
            self._pop(plan.taken)
            self._taken = 0

    def _send_artifact(self, client: MlflowClient, state: RunState, item: ops.Artifact) -> None:
        if item.is_dir:
            client.log_artifacts(state.run_id, item.local_path, item.artifact_path)
        else:
            client.log_artifact(state.run_id, item.local_path, item.artifact_path)

    def _record_model(self, seq: int, model_id: str) -> None:
        if self.journal is not None:
            self.journal.record_model(seq, model_id)

    def _upload_events(self, client: MlflowClient, state: RunState) -> None:
        path = os.path.join(self.staging_dir, EVENTS_FILE)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(state.event_lines) + "\n")
        client.log_artifact(state.run_id, path)  # the whole file: re-sending it is harmless
        self._events_dirty = False

    def _pop(self, n: int) -> None:
        with self._cond:
            self._solo = max(0, self._solo - n)
            done = [self._queue.popleft() for _ in range(n)]
            for item in done:
                self.sent += item.size
                if isinstance(item, (ops.Metrics, ops.SystemMetrics)):
                    self._buffered -= item.size
        self._done(done)

    def _done(self, items: List) -> None:
        """The items left the queue for good: acknowledge them, then drop our staged copies
        (in that order: a crash in between leaves a copy, never an item without its file)."""
        if self.journal is not None and items[-1].seq:
            ended = items[-1].status if isinstance(items[-1], ops.Terminate) else None
            self.journal.ack(items[-1].seq, ended, self.state.run_id if self.state else None)
        for item in items:
            if isinstance(item, ops.Model) or (isinstance(item, ops.Artifact) and item.staged):
                shutil.rmtree(os.path.dirname(item.local_path), ignore_errors=True)

    # ---- outages and refusals ----------------------------------------------------------------
    def _went_down(self, exc: BaseException) -> None:
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        first = not self._warned_down
        self._warned_down = True
        log.log(logging.WARNING if first else logging.INFO,
                "MLflow tracking server %s unreachable (%s); buffering in memory and retrying, "
                "training goes on", self.tracking_uri, _short(exc))

    def _back_up(self) -> None:
        if self._down_since is None:
            return
        down = time.monotonic() - self._down_since
        self._down_since = None
        log.info("MLflow tracking server %s reachable again after %.0f s; sending the %d buffered "
                 "item(s)", self.tracking_uri, down, self.pending)

    def _refused(self, exc: BaseException) -> None:
        """MLflow refused what was sent: drop the culprit and say so, a few times. A refused
        batch of several items is first retried item by item, so only the bad one is lost."""
        if self._taken > 1:
            self._solo, self._taken = self._taken, 0
            return
        self._taken = 0
        if self._events_dirty:
            self._events_dirty = False
            dropped = 1
        else:
            with self._cond:
                item = self._queue.popleft()
                dropped = item.size
                self._solo = max(0, self._solo - 1)
                if isinstance(item, (ops.Metrics, ops.SystemMetrics)):
                    self._buffered -= item.size
            self._done([item])
        self.failed += dropped
        self._errors_logged += 1
        if self._errors_logged <= _MAX_ERRORS_LOGGED:
            log.error("MLflow refused %d item(s), dropped: %s", dropped, _short(exc))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
