"""RunTracker: one MLflow run per training job, logged from the driver without ever blocking it.

    tracker = RunTracker("gpt-350m-a", params=cfg)          # returns at once
    tracker.system_metrics(True)
    tracker.log_metrics({"loss": 2.31, "tokens_per_s": 9.1e4}, step=100)
    tracker.event("worker 2 lost", kind="failure")
    tracker.log_dict(cfg.to_dict(), "config.json")
    report = tracker.close("FINISHED")                      # flushes, at most timeout_s

Every call only queues (see sender.py): the tracking server may be down at start, go away and
come back; training never waits for it and nothing queued is lost unless close() runs out of time.

With spool_dir (the LM job passes <run folder>/mlflow) every item is also journaled on disk as it
is queued (journal.py): what MLflow has not acknowledged when close() gives up, or when the driver
is killed, is sent first by the next RunTracker of the run on that spool, or by
`hybrid-ray mlflow sync <run folder>` (sync.py), which also ends the run with the status close()
recorded (KILLED if the writer died without one).
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import dataclasses
from typing import Any, Dict, Mapping, Optional

from . import ops
from .journal import STAGED, Journal, release_lock, sync_command, take_lock
from .outputs import dataset_item
from .run import RUN_NAME_TAG
from .sender import FlushReport, Sender
from .system import SystemMonitor
from .values import flat_params, key, metric_value, tag_value

log = logging.getLogger("hybrid_ray.tracking")

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow 3's default; `mlflow ui` finds it
_COPY_LIMIT = 256 * 2 ** 20  # artifacts up to this size are copied at the call (see log_artifact)
_CHUNK = 100                 # MLflow's per-batch limit on params and tags


def _client_defaults(timeout_s: int) -> None:
    # MLflow's client retries a refused connection 7 times with backoff (minutes); the sender
    # retries on its own schedule, so one attempt per call. Progress bars for each artifact
    # would fill the job log. Each is left alone if the user set it.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # MLflow prints "View run ... at" lines when a run ends; the job prints where the run is once.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def _now_ms() -> int:
    return int(time.time() * 1000)


class RunTracker:
    """MLflow logging for one training job (run_name) from the driver; see the module docstring."""

    def __init__(self, run_name: str, experiment: str = "hybrid_ray",
                 tracking_uri: Optional[str] = None, params: Any = None,
                 tags: Optional[Mapping[str, Any]] = None, *, max_buffered: int = 500_000,
                 max_backoff_s: float = 30.0, http_timeout_s: int = 20,
                 spool_dir: Optional[str] = None):
        """run_name: the job's name; a run tagged with it in `experiment` is continued.
        tracking_uri: default MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir.
        params: logged at once (a Config, dataclass or nested mapping; see log_params).
        max_buffered: metric values held during an outage; newer ones are dropped beyond it.
        max_backoff_s: longest pause between reconnection attempts.
        http_timeout_s: MLFLOW_HTTP_REQUEST_TIMEOUT unless already set.
        spool_dir: a local folder for the journal (see the module docstring); items an earlier
        tracker of this run left there unsent are sent first. JournalError if a live process
        is writing it."""
        if not run_name or "'" in run_name or "`" in run_name:
            raise ValueError(f"RunTracker: run_name: invalid; got {run_name!r}; allowed: a "
                             "non-empty name without quotes or backticks (it is searched for)")
        self.run_name, self.experiment = run_name, experiment
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
        _client_defaults(http_timeout_s)
        self.spool_dir = os.path.abspath(spool_dir) if spool_dir else None
        journal, replay = self._open_spool()
        self._staging = (os.path.join(self.spool_dir, STAGED) if journal
                         else tempfile.mkdtemp(prefix="hybrid_ray-mlflow-"))
        self._last_step = 0
        self._system: Optional[SystemMonitor] = None
        self._remote_samples: Dict[str, int] = {}  # per source: system samples logged for it
        self._closed: Optional[FlushReport] = None
        self._warned_closed = False
        self._sender = Sender(self.tracking_uri, experiment, run_name, self._staging,
                              max_buffered, max_backoff_s, journal)
        for item in replay:  # an earlier session's unsent items go first, in their order
            self._sender.put(item, replay=True)
        if tags:  # queued rather than given to create_run: a resumed run gets them too
            self.set_tags(tags)
        if params is not None:
            self.log_params(params)
        atexit.register(self._at_exit)  # a driver that never calls close() still flushes

    def _open_spool(self) -> tuple:
        if self.spool_dir is None:
            return None, []
        take_lock(self.spool_dir)
        journal = Journal.read(self.spool_dir)
        replay = journal.start(self.tracking_uri, self.experiment, self.run_name)
        if replay:
            log.info("MLflow: %d item(s) left unsent in %s by an earlier session are sent first",
                     len(replay), self.spool_dir)
        return journal, replay

    # ---- the run ------------------------------------------------------------------------------
    @property
    def run_id(self) -> Optional[str]:
        """The MLflow run id once the run is open (None while the server was not reached yet)."""
        state = self._sender.state
        return None if state is None else state.run_id

    @property
    def experiment_id(self) -> Optional[str]:
        """The MLflow experiment's id once the run is open."""
        state = self._sender.state
        return None if state is None else state.experiment_id

    def where(self) -> str:
        """One line: which run this is and how to look at it."""
        if self.run_id is None:
            if self.spool_dir is not None:
                return (f"MLflow: run {self.run_name!r} not recorded yet: {self.tracking_uri} was "
                        f"never reached; its records are spooled: `{sync_command(self.spool_dir)}`")
            return f"MLflow: run {self.run_name!r} was not recorded: {self.tracking_uri} was never reached"
        return "MLflow: " + describe_run(self.tracking_uri, self.experiment_id, self.run_id, self.run_name)

    @property
    def resumed(self) -> Optional[bool]:
        """True if this tracker continues a run an earlier session made."""
        state = self._sender.state
        return None if state is None else state.resumed

    @property
    def pending(self) -> int:
        """Items queued but not yet acknowledged by MLflow."""
        return self._sender.pending

    # ---- logging --------------------------------------------------------------------------------
    def log_params(self, params: Any) -> None:
        """Log a Config, dataclass or nested mapping as flat params ('zero_optimization.stage').
        A param already logged with the same value is skipped; a different value (a resumed
        job with a changed setting) is recorded as the tag 'param_changed.<key>'."""
        flat = list(flat_params(params).items())
        for i in range(0, len(flat), _CHUNK):
            self._put(ops.Params(dict(flat[i:i + _CHUNK])))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values are strings in MLflow; later values replace earlier ones)."""
        items = list({key(k): tag_value(v) for k, v in tags.items()}.items())
        for i in range(0, len(items), _CHUNK):
            self._put(ops.Tags(dict(items[i:i + _CHUNK])))

    def log_metrics(self, metrics: Mapping[str, Any], step: int, monotonic: bool = True) -> bool:
        """Log the numeric values of `metrics` at `step`; other values (None, strings) and the
        key 'step' itself are skipped. monotonic: a key's step at or below one already logged
        (steps replayed after a recovery) is dropped, so each step appears once, in order.
        False if the values were dropped because the outage buffer is full."""
        ts = _now_ms()
        self._last_step = max(self._last_step, int(step))
        items = []
        for name, value in metrics.items():
            number = metric_value(value)
            if number is not None and name != "step":
                items.append((key(name), number, int(step), ts))
        if not items:
            return True
        return all([self._put(ops.Metrics(items[i:i + 1000], monotonic))
                    for i in range(0, len(items), 1000)])

    def event(self, text: str, kind: Optional[str] = None, step: Optional[int] = None,
              **fields: Any) -> None:
        """Record a membership or failure event: a line in the run's events.log, the tag
        'hybrid_ray.last_event', the running count 'events/count/<kind>' and each numeric field
        as the metric 'events/<field>' (e.g. recovery_s=12.5), at `step` (default: the last step
        logged). kind: default guessed from the text ('failure', 'resize' or 'info')."""
        kind = key(kind or classify(text))
        step = self._last_step if step is None else int(step)
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        extra = " " + json.dumps(fields, default=str, sort_keys=True) if fields else ""
        values = {key(k): v for k, v in ((k, metric_value(v)) for k, v in fields.items()) if v is not None}
        self._put(ops.Event(text, kind, f"{stamp} step {step} [{kind}] {text}{extra}",
                                   values, step, _now_ms()))

    # ---- artifacts ------------------------------------------------------------------------------
    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        """Upload a file or directory (under `artifact_path` in the run). Up to 256 MiB it is
        copied now, so later changes or deletion do not matter; a larger one is uploaded from
        where it is and must stay there until it has been sent."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"log_artifact: {path}: no such file or directory")
        is_dir = os.path.isdir(path)
        if _size(path) > _COPY_LIMIT:
            self._put(ops.Artifact(path, artifact_path, staged=False, is_dir=is_dir))
            return
        target = os.path.join(self._stage_dir(), os.path.basename(os.path.normpath(path)))
        if is_dir:
            shutil.copytree(path, target)
        else:
            shutil.copy2(path, target)
        self._put(ops.Artifact(target, artifact_path, staged=True, is_dir=is_dir))

    def log_dict(self, obj: Any, name: str) -> None:
        """Upload `obj` as JSON (or YAML for a .yaml/.yml name) to `name`, e.g. 'config.json'."""
        if name.endswith((".yaml", ".yml")):
            import yaml
            text = yaml.safe_dump(obj, sort_keys=False)
        else:
            text = json.dumps(obj, indent=2, sort_keys=False, default=str)
        self.log_text(text, name)

    def log_text(self, text: str, name: str) -> None:
        """Upload `text` as the file `name` ('reports/flops.txt': under reports/)."""
        target = os.path.join(self._stage_dir(), os.path.basename(name))
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        self._put(ops.Artifact(target, os.path.dirname(name) or None, staged=True))

    # ---- model and data ---------------------------------------------------------------------------
    def log_model(self, model: Any, name: str = "model", step: Optional[int] = None,
                  **save_kwargs: Any) -> None:
        """Save `model` (a torch.nn.Module) now with MLflow's PyTorch flavour and queue it as an
        MLflow LoggedModel of this run, output at `step` (default: the last step logged); load
        it back with mlflow.pytorch.load_model("models:/<id>"). save_kwargs go to
        mlflow.pytorch.save_model; pip requirements default to the flavour's own (torch,
        cloudpickle), which spares MLflow's slow requirement inference. Without an
        input_example the model is pickled (loading it imports its class, e.g. hybrid_ray's
        GPT); with one, MLflow's default applies (pt2: torch.export, traced at that shape)."""
        import mlflow.pytorch

        # MLflow warns on every save that pickle is unsafe and that torch's "+cpu" label was left
        # out of the pin: choices made here on purpose, not news for the job log.
        quiet = [logging.getLogger(n) for n in ("mlflow.pytorch", "mlflow.utils.requirements_utils")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            save_kwargs.setdefault("pip_requirements", mlflow.pytorch.get_default_pip_requirements())
            if save_kwargs.get("input_example") is None:
                save_kwargs.setdefault("serialization_format", "pickle")
            target = os.path.join(self._stage_dir(), key(name))
            mlflow.pytorch.save_model(model, target, **save_kwargs)
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
        self._put(ops.Model(target, name, self._last_step if step is None else int(step)))

    def log_dataset(self, name: str, source: str, digest: str, profile: Optional[Mapping] = None,
                    context: str = "training") -> None:
        """Log the dataset at `source` (path or URI) as the run's input: `digest` names its
        version (same data, same digest), `profile` a few numbers about it (e.g. token counts)."""
        text = json.dumps(dict(profile), sort_keys=True) if profile else None
        self._put(dataset_item(name, source, digest, text, context))

    def _put(self, item: object) -> bool:
        if self._closed is not None:  # after close() nothing would send it
            if not self._warned_closed:
                self._warned_closed = True
                log.warning("RunTracker(%r) is closed; later calls are ignored", self.run_name)
            return False
        return self._sender.put(item)

    def _stage_dir(self) -> str:
        # One directory per item: two uploads of one name never share a file, nor do two
        # sessions on one spool.
        return tempfile.mkdtemp(prefix="item-", dir=self._staging)

    # ---- system metrics and the end ---------------------------------------------------------------
    def system_metrics(self, enabled: bool = True, interval_s: float = 10.0,
                       samples_before_logging: int = 1) -> None:
        """Start (or stop) logging this host's CPU, memory, disk, network and GPU metrics."""
        if enabled and self._system is None:
            self._system = SystemMonitor(self._publish_system, interval_s, samples_before_logging)
        elif not enabled and self._system is not None:
            self._system.stop()
            self._system = None

    def _publish_system(self, values: Dict[str, float], index: int, ts: int) -> None:
        self._put(ops.SystemMetrics(values, index, ts))

    def log_system_metrics(self, values: Mapping[str, float], source: str,
                           timestamp_ms: Optional[int] = None) -> None:
        """System metrics sampled on another host (a worker node), keys already under their
        own `system/<node>/` prefix. Numbered here, per source, rather than by the sampler: a
        node's sampler can move to another worker after a loss and would count from 0 again."""
        index = self._remote_samples[source] = self._remote_samples.get(source, -1) + 1
        self._put(ops.SystemMetrics({k: float(v) for k, v in values.items()}, index,
                                    timestamp_ms or _now_ms()))

    def close(self, status: str = "FINISHED", timeout_s: float = 30.0) -> FlushReport:
        """End the run with `status` (FINISHED, FAILED or KILLED) after sending what is queued,
        waiting at most timeout_s; the report says what could not be sent. Idempotent."""
        if self._closed is not None:
            return self._closed
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"close: status: invalid; got {status!r}; allowed: FINISHED, FAILED, KILLED")
        atexit.unregister(self._at_exit)
        self.system_metrics(False)
        self._put(ops.Terminate(status, _now_ms()))
        self._closed = self._sender.close(timeout_s)
        if self.spool_dir is None:
            if self._closed.unsent == 0:
                shutil.rmtree(self._staging, ignore_errors=True)
            return self._closed
        self._sender.journal.close()
        release_lock(self.spool_dir)
        if self._closed.unsent:
            log.warning("MLflow: %s not reached in time; %d item(s) and the run's end (%s) are spooled in "
                        "%s: send them with `%s`", self.tracking_uri, self._closed.unsent, status,
                        self.spool_dir, sync_command(self.spool_dir))
            self._closed = dataclasses.replace(self._closed, spooled_in=self.spool_dir)
        return self._closed

    def _at_exit(self) -> None:
        # sys.last_value is set when the interpreter printed an unhandled exception.
        self.close("FAILED" if getattr(sys, "last_value", None) is not None else "FINISHED",
                   timeout_s=10.0)

    def __enter__(self) -> "RunTracker":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")


def describe_run(tracking_uri: str, experiment_id: str, run_id: str, run_name: str) -> str:
    """'run ID (NAME): URL', or how to open a local store's UI at it."""
    path = f"#/experiments/{experiment_id}/runs/{run_id}"
    if tracking_uri.startswith(("http://", "https://")):
        return f"run {run_id} ({run_name}): {tracking_uri.rstrip('/')}/{path}"
    return (f"run {run_id} ({run_name}) in {tracking_uri}: "
            f"`mlflow ui --backend-store-uri {tracking_uri}`, then http://127.0.0.1:5000/{path}")


def classify(text: str) -> str:
    """A default kind for an event message from the controller: 'failure', 'resize' or 'info'."""
    lower = text.lower()
    if any(w in lower for w in ("lost", "failed", "failure", "no step for")):
        return "failure"
    if any(w in lower for w in ("grow", "resize", "shrink", "placed")):
        return "resize"
    return "info"


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


__all__ = ["RunTracker", "FlushReport", "classify", "DEFAULT_TRACKING_URI", "RUN_NAME_TAG"]
