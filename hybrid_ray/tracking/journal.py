"""The spool: a durable journal of what a RunTracker queued, so nothing is lost when the
tracking server is down at the end of a run or the driver is killed.

    <spool>/journal.jsonl   line 1 a header {"format", "version", "tracking_uri", "experiment",
                            "run_name"}; then one item per line {"seq", "op", fields...}
                            (ops.to_record), appended and flushed as each item is queued
    <spool>/ack.json        {"version", "seq": highest seq MLflow acknowledged, "run_id",
                            "ended": the status of an acknowledged Terminate (null while open),
                            "models": {seq: LoggedModel id}}, replaced atomically
    <spool>/writer.lock     {"pid", "host"} of the tracker writing the journal
    <spool>/staged/         copies of artifacts and saved models, removed once acknowledged

Items are sent in seq order and acknowledged in that order, so one number says what is done. A
line cut short by a kill (the last one) is ignored; each start rewrites the journal as header +
unacknowledged items, which keeps it small and drops a torn tail before anything is appended.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any, Dict, List, Optional

import psutil

from . import ops

log = logging.getLogger("hybrid_ray.tracking")

FORMAT, VERSION = "hybrid_ray-mlflow-journal", 1
JOURNAL, ACK, LOCK, STAGED = "journal.jsonl", "ack.json", "writer.lock", "staged"


class JournalError(RuntimeError):
    """A spool that cannot be used: another run's, a newer format, or a live writer."""


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


class Journal:
    """One spool directory; read() it, then start() it to append (see the module docstring)."""

    def __init__(self, spool_dir: str):
        self.dir = os.path.abspath(spool_dir)
        self.header: Optional[Dict[str, Any]] = None
        self.items: List[Any] = []  # unacknowledged, in seq order
        self.acked, self.run_id, self.ended = 0, None, None
        self.models: Dict[str, str] = {}
        self._next = 1
        self._file = None

    # ---- reading ------------------------------------------------------------------------------
    @classmethod
    def read(cls, spool_dir: str) -> "Journal":
        """The spool as it is on disk (an empty one if there is none); writes nothing."""
        j = cls(spool_dir)
        j._read_ack()
        path = os.path.join(j.dir, JOURNAL)
        if not os.path.exists(path):
            return j
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if n < len(lines) - 1 and any(x.strip() for x in lines[n + 1:]):
                    log.warning("%s: line %d is not JSON; skipped", path, n + 1)
                continue  # the last line, cut short by a kill: never acknowledged, never whole
            j._take(record, path)
        return j

    def _take(self, record: Dict[str, Any], path: str) -> None:
        if self.header is None:
            if record.get("format") != FORMAT or record.get("version", 0) > VERSION:
                raise JournalError(f"{path}: not a version-{VERSION} {FORMAT} (header {record})")
            self.header = record
            return
        item = ops.from_record(record)
        self._next = max(self._next, item.seq + 1)
        if item.seq > self.acked:
            if isinstance(item, ops.STAGED) and not os.path.isabs(item.local_path):
                item.local_path = os.path.join(self.dir, item.local_path)
            if isinstance(item, ops.Model) and item.model_id is None:
                item.model_id = self.models.get(str(item.seq))
            self.items.append(item)

    def _read_ack(self) -> None:
        path = os.path.join(self.dir, ACK)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                ack = json.load(f)
            self.acked, self.run_id, self.ended = ack["seq"], ack.get("run_id"), ack.get("ended")
            self.models = dict(ack.get("models", {}))
            self._next = self.acked + 1

    @property
    def pending(self) -> int:
        return len(self.items)

    # ---- writing ------------------------------------------------------------------------------
    def start(self, tracking_uri: str, experiment: str, run_name: str,
              resume: bool = True) -> List[Any]:
        """Open for appending: rewrite the journal as a header for this session plus the items
        still unacknowledged (returned, to be sent first). The spool must be this run's.
        resume: a new session of the run: an earlier session's Terminate is dropped (this
        session ends the run), and the run counts as open until this one's end is acknowledged."""
        if self.header is not None and self.header.get("run_name") != run_name:
            raise JournalError(f"spool {self.dir} holds run {self.header.get('run_name')!r}, "
                               f"not {run_name!r}")
        if resume:
            self.items = [i for i in self.items if not isinstance(i, ops.Terminate)]
            self.ended = None
        os.makedirs(os.path.join(self.dir, STAGED), exist_ok=True)
        if tracking_uri.startswith("sqlite:///") and not tracking_uri.startswith("sqlite:////"):
            # A relative database (MLflow's default sqlite:///mlflow.db) is the writer's working
            # directory's: sync, run from anywhere, must find the same one.
            tracking_uri = "sqlite:///" + os.path.abspath(tracking_uri[len("sqlite:///"):])
        self.header = {"format": FORMAT, "version": VERSION, "tracking_uri": tracking_uri,
                       "experiment": experiment, "run_name": run_name}
        lines = [self.header] + [self._record(item) for item in self.items]
        _write_atomic(os.path.join(self.dir, JOURNAL), "".join(json.dumps(r) + "\n" for r in lines))
        self._file = open(os.path.join(self.dir, JOURNAL), "a", encoding="utf-8")
        self._write_ack()
        return list(self.items)

    def _record(self, item: Any) -> Dict[str, Any]:
        record = ops.to_record(item)
        path = record.get("local_path")
        if path and os.path.abspath(path).startswith(self.dir + os.sep):
            record["local_path"] = os.path.relpath(path, self.dir)  # the run folder may move
        return record

    def append(self, item: Any) -> None:
        """Number the item and write it to disk (flushed: it survives a SIGKILL from here on)."""
        item.seq = self._next
        self._next += 1
        self._file.write(json.dumps(self._record(item)) + "\n")
        self._file.flush()

    def ack(self, seq: int, ended: Optional[str] = None, run_id: Optional[str] = None) -> None:
        """MLflow acknowledged every item up to seq (ended: that included a Terminate)."""
        self.acked = max(self.acked, seq)
        self.run_id = run_id or self.run_id
        self.ended = ended or self.ended
        self.models = {k: v for k, v in self.models.items() if int(k) > self.acked}
        self._write_ack()

    def record_model(self, seq: int, model_id: str) -> None:
        """The LoggedModel made for item seq: a retry after a crash uploads into it."""
        self.models[str(seq)] = model_id
        self._write_ack()

    def _write_ack(self) -> None:
        _write_atomic(os.path.join(self.dir, ACK), json.dumps(
            {"version": VERSION, "seq": self.acked, "run_id": self.run_id, "ended": self.ended,
             "models": self.models}))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def sync_command(spool_dir: str) -> str:
    """The command that sends what the spool holds (its run folder when it is <run>/mlflow)."""
    spool = os.path.abspath(spool_dir)
    target = os.path.dirname(spool) if os.path.basename(spool) == "mlflow" else spool
    return f"hybrid-ray mlflow sync {target}"


# ---- the writer's lock ------------------------------------------------------------------------
def live_writer(spool_dir: str) -> Optional[str]:
    """'pid P on HOST' when another live process of this host holds the spool's lock; None when
    nobody does or the holder is gone. A holder on another host (a run folder on a shared file
    system) cannot be checked: it is warned about and taken to be gone, since a driver that
    moved host after a failure must not be locked out of its own run forever."""
    path = os.path.join(spool_dir, LOCK)
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    pid, host = int(holder.get("pid", 0)), holder.get("host")
    if host != socket.gethostname():
        log.warning("%s: last written by pid %d on %s, which cannot be checked from here; taking "
                    "it over", spool_dir, pid, host)
        return None
    if pid == os.getpid() or not psutil.pid_exists(pid):
        return None
    return f"pid {pid} on {host}"


def take_lock(spool_dir: str) -> None:
    """Claim the spool for this process; JournalError if a live writer holds it."""
    holder = live_writer(spool_dir)
    if holder is not None:
        raise JournalError(f"spool {spool_dir} is being written by {holder}; wait for it to end "
                           f"(or remove {os.path.join(spool_dir, LOCK)} if that process is gone)")
    os.makedirs(spool_dir, exist_ok=True)
    _write_atomic(os.path.join(spool_dir, LOCK),
                  json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def release_lock(spool_dir: str) -> None:
    path = os.path.join(spool_dir, LOCK)
    try:
        with open(path, encoding="utf-8") as f:
            mine = json.load(f).get("pid") == os.getpid()
    except (OSError, ValueError):
        return
    if mine:
        os.remove(path)
