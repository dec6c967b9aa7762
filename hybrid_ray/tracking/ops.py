"""The items a RunTracker queues for its sender thread, in call order.

Every item is safe to send twice: metrics carry the timestamp of the call, and MLflow's SQL
store keeps one row per (key, timestamp, step, value); params are re-sent with the value they
already have; tags, artifacts and the run status are overwritten with the same content. So a
batch whose reply was lost (a timeout after the server applied it) is simply sent again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class Metrics:
    items: List[Tuple[str, float, int, int]]
    """(key, value, step, timestamp in ms)."""
    monotonic: bool = True
    """Drop a key's step at or below the largest step already logged for it (a replay)."""

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass
class SystemMetrics:
    values: Dict[str, float]
    index: int
    """This session's sample number; the run's step is the resumed base + index."""
    timestamp: int

    @property
    def size(self) -> int:
        return len(self.values)


@dataclass
class Params:
    items: Dict[str, str]

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass
class Tags:
    items: Dict[str, str]

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

    @property
    def size(self) -> int:
        return 1


@dataclass
class Terminate:
    status: str
    end_time: int

    @property
    def size(self) -> int:
        return 1


BATCHED = (Metrics, SystemMetrics, Params, Tags, Event)
