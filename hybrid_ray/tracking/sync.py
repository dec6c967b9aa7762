"""Send what a run's spool holds to MLflow: `hybrid-ray mlflow sync RUN_DIR`.

RUN_DIR is the run folder (its spool is RUN_DIR/mlflow) or the spool itself. The journal's
header names the tracking URI, experiment and run, so nothing else is needed; --tracking-uri
sends to another server. Items go in journal order, each once, and the run ends with the status
its last session's close() recorded. A journal whose writer is gone without a close() (a driver
killed by SIGKILL, a lost node) ends the run KILLED, with the tag hybrid_ray.ended_by saying so.
Refused while the writer is alive (its lock names a live pid on this host).

Exit codes: 0 sent (or nothing to send), 1 not sent (server unreachable, writer alive, no
spool); nothing is lost when it fails: the journal stays as it was.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional

from . import ops
from .journal import JOURNAL, STAGED, Journal, JournalError, live_writer, release_lock, take_lock
from .sender import Sender, _short
from .tracker import _client_defaults, describe_run

ENDED_BY_TAG = "hybrid_ray.ended_by"


@dataclass(frozen=True)
class SyncResult:
    code: int
    """0 sent or nothing to send, 1 not sent."""
    line: str
    """What happened, in one line."""


def find_spool(run_dir: str) -> Optional[str]:
    """RUN_DIR/mlflow, or RUN_DIR itself, whichever holds a journal."""
    for spool in (os.path.join(run_dir, "mlflow"), run_dir):
        if os.path.isfile(os.path.join(spool, JOURNAL)):
            return spool
    return None


def sync(run_dir: str, tracking_uri: Optional[str] = None, timeout_s: float = 300.0) -> SyncResult:
    """Send everything pending in the run's spool; see the module docstring."""
    spool = find_spool(run_dir)
    if spool is None:
        return SyncResult(1, f"error: no MLflow spool in {run_dir} (no mlflow/{JOURNAL})")
    try:
        journal = Journal.read(spool)
    except (JournalError, ValueError) as exc:
        return SyncResult(1, f"error: {exc}")
    header = journal.header or {}
    name, uri = header.get("run_name"), tracking_uri or header.get("tracking_uri")
    holder = live_writer(spool)
    if holder is not None:
        return SyncResult(1, f"error: run {name!r} is still being written by {holder}; its "
                             "tracker sends its own records (sync once it has ended)")
    if not journal.items and journal.ended:
        return SyncResult(0, f"nothing to send: run {name!r} ({journal.run_id}) ended "
                             f"{journal.ended}; every record was acknowledged")
    _client_defaults(20)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # we print one line
    reason = _unreachable(uri)
    if reason is not None:
        return SyncResult(1, f"error: MLflow at {uri} cannot be reached ({reason}); nothing sent, "
                             f"the {journal.pending} item(s) stay in {spool}")
    return _send(journal, spool, uri, header, timeout_s)


def _unreachable(uri: str) -> Optional[str]:
    """Why the tracking server cannot be used now (None: it answers)."""
    from mlflow import MlflowClient

    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is one line for the user
        return _short(exc)
    return None


def _send(journal: Journal, spool: str, uri: str, header: dict, timeout_s: float) -> SyncResult:
    take_lock(spool)  # a tracker starting on this spool now waits for us (it is refused)
    try:
        items = journal.start(uri, header["experiment"], header["run_name"], resume=False)
        sender = Sender(uri, header["experiment"], header["run_name"], os.path.join(spool, STAGED),
                        max_buffered=2 ** 62, max_backoff_s=2.0, journal=journal)
        for item in items:
            sender.put(item, replay=True)
        if not items or not isinstance(items[-1], ops.Terminate):
            # The writer is gone (no live lock) and never closed the run: it was killed.
            ended = [ops.Tags({ENDED_BY_TAG: "hybrid-ray mlflow sync: the run's driver stopped "
                                             "without closing the run"}),
                     ops.Terminate("KILLED", int(time.time() * 1000))]
            for item in ended:
                sender.put(item)  # journaled too: a sync cut short does it next time
            items += ended
        report = sender.close(timeout_s)
        state = sender.state
    finally:
        journal.close()
        release_lock(spool)
    if report.unsent:
        return SyncResult(1, f"error: {report.unsent} item(s) not acknowledged by {uri} within "
                             f"{timeout_s:.0f} s; they stay in {spool}: run the command again")
    where = describe_run(uri, state.experiment_id, state.run_id, header["run_name"])
    return SyncResult(0, f"sent {_counts(items)}; {where}")


def _counts(items: List) -> str:
    """'12 metric values, 3 params, 2 tags, 1 artifact, status FINISHED'."""
    n: Counter = Counter()
    status = None
    for item in items:
        if isinstance(item, (ops.Metrics, ops.SystemMetrics)):
            n["metric values"] += item.size
        elif isinstance(item, ops.Event):
            n["events"] += 1
        elif isinstance(item, ops.Params):
            n["params"] += item.size
        elif isinstance(item, ops.Tags):
            n["tags"] += item.size
        elif isinstance(item, ops.Artifact):
            n["artifacts"] += 1
        elif isinstance(item, ops.Model):
            n["models"] += 1
        elif isinstance(item, ops.Dataset):
            n["datasets"] += 1
        elif isinstance(item, ops.Terminate):
            status = item.status
    parts = [f"{v} {k}" for k, v in n.items()]
    return ", ".join(parts + [f"status {status}"])
