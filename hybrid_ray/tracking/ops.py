"""The items a RunTracker queues for its sender thread, in call order.

With a spool (journal.py) each item is also written to disk as one JSON line (to_record), and
`seq`, its number in the journal, tells which items MLflow has acknowledged.

Every item is safe to send twice: metrics carry the timestamp of the call, and MLflow's SQL
store keeps one row per (key, timestamp, step, value); params are re-sent with the value they
already have; tags, artifacts and the run status are overwritten with the same content. So a
batch whose reply was lost (a timeout after the server applied it) is simply sent again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class Metrics:
    items: List[Tuple[str, float, int, int]]
    """(key, value, step, timestamp in ms)."""
    monotonic: bool = True
    """Drop a key's step at or below the largest step already logged for it (a replay)."""

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass
class SystemMetrics:
    values: Dict[str, float]
    index: int
    """This session's sample number; the run's step is the resumed base + index."""
    timestamp: int

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return len(self.values)


@dataclass
class Params:
    items: Dict[str, str]

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass
class Tags:
    items: Dict[str, str]

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass
class Event:
    text: str
    kind: str
    line: str
    """The events.log line."""
    values: Dict[str, float] = field(default_factory=dict)
    """Numeric fields, logged as metrics `events/<name>` (e.g. recovery_s)."""
    step: int = 0
    timestamp: int = 0

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return 1 + len(self.values)


@dataclass
class Artifact:
    local_path: str
    artifact_path: Optional[str]
    staged: bool
    """local_path is our own copy, deleted once uploaded."""
    is_dir: bool = False

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return 1


@dataclass
class Terminate:
    status: str
    end_time: int

    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return 1


@dataclass
class Model:
    """A model saved in MLflow's format (local_path, staged) to become a LoggedModel of the run."""

    local_path: str
    name: str
    step: int = 0
    params: Dict[str, str] = field(default_factory=dict)
    model_type: Optional[str] = None
    model_id: Optional[str] = None
    """Set once MLflow created the LoggedModel, so a retry uploads into the same one."""
    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return 1


@dataclass
class Dataset:
    """A dataset input of the run: the fields of mlflow.entities.Dataset, and its context."""

    name: str
    digest: str
    source_type: str
    source: str
    context: str = "training"
    schema: Optional[str] = None
    profile: Optional[str] = None
    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        return 1


BATCHED = (Metrics, SystemMetrics, Params, Tags, Event)
KINDS = {"metrics": Metrics, "system": SystemMetrics, "params": Params, "tags": Tags, "event": Event,
         "artifact": Artifact, "terminate": Terminate, "model": Model, "dataset": Dataset}
_NAMES = {cls: name for name, cls in KINDS.items()}
STAGED = (Artifact, Model)  # items whose local_path may be our own copy, removed once sent


def to_record(item: Any) -> Dict[str, Any]:
    """The item as one JSON-able dict: {"seq", "op", fields...}."""
    fields = {f.name: getattr(item, f.name) for f in dataclasses.fields(item) if f.name != "seq"}
    return {"seq": item.seq, "op": _NAMES[type(item)], **fields}


def from_record(record: Dict[str, Any]) -> Any:
    """The item to_record wrote; ValueError for an unknown op (a newer writer's)."""
    cls = KINDS.get(record.get("op"))
    if cls is None:
        raise ValueError(f"unknown journal op {record.get('op')!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    item = cls(**{k: v for k, v in record.items() if k in names})
    if isinstance(item, Metrics):  # JSON has no tuples
        item.items = [tuple(x) for x in item.items]
    return item
