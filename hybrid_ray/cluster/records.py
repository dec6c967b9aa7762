"""What workers send the driver: typed records, each of one kind.

A training function reports numbers with `ctx.report({...})` (a Metrics record) and may send
the other kinds itself; the worker actor adds its node's system samples. The controller forwards
every record to the driver's `on_record` without looking inside; whoever runs the driver (the LM
job's router, hybrid_ray/lm/elastic.py) decides what each kind becomes. No Ray here: records are
built on the workers, under torchrun too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Mapping, Optional


class Record:
    """Base of every record; `kind` names it in logs and files."""

    kind: ClassVar[str] = "record"

    def to_json(self) -> Dict[str, Any]:
        """The record as one JSON object (a line of the run's metrics.jsonl)."""
        raise NotImplementedError


class Metrics(dict, Record):
    """Numbers of one step (losses, rates, sizes), as `ctx.report(dict)` sends them: that dict,
    with `world_size` (of the group that reported it) added where absent. A dict, so it goes
    into JSON and reads as before."""

    kind = "metrics"

    def __init__(self, values: Mapping[str, Any], world_size: Optional[int] = None):
        super().__init__(values)
        if world_size is not None:
            self.setdefault("world_size", world_size)

    @property
    def step(self) -> Optional[int]:
        return self.get("step")

    def __repr__(self) -> str:
        return f"Metrics({dict.__repr__(self)})"

    def to_json(self) -> Dict[str, Any]:
        return dict(self)


@dataclass(frozen=True)
class Params(Record):
    """Settings only the built run knows (the model's size, the precision in force)."""

    kind: ClassVar[str] = "params"
    params: Dict[str, Any]

    def to_json(self) -> Dict[str, Any]:
        return {"params": self.params}


@dataclass(frozen=True)
class Text(Record):
    """A text artifact of the run, e.g. one step's flops profile ("reports/flops.txt")."""

    kind: ClassVar[str] = "text"
    name: str
    text: str
    step: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "text": self.name}


@dataclass(frozen=True)
class SystemSample(Record):
    """One sample of a worker node's system metrics (CPU, memory, disk, network, GPUs)."""

    kind: ClassVar[str] = "system"
    node: str  # the node's label: system/<node>/... in MLflow
    values: Dict[str, float] = field(default_factory=dict)
    timestamp_ms: int = 0

    def to_json(self) -> Dict[str, Any]:
        return {"system_metrics": self.values, "node": self.node, "timestamp_ms": self.timestamp_ms}


@dataclass(frozen=True)
class LinkProbe(Record):
    """The group's all-reduce bus bandwidth, measured when it formed (None: one rank)."""

    kind: ClassVar[str] = "link"
    world_size: int
    bandwidth: Optional[float] = None  # bytes/s

    def to_json(self) -> Dict[str, Any]:
        return {"link": {"world_size": self.world_size, "bandwidth": self.bandwidth}}


@dataclass(frozen=True)
class Interval(Record):
    """Rank 0's timing of one logging interval, under the compression setting in force."""

    kind: ClassVar[str] = "interval"
    setting_id: int  # the driver's directive in force (0: the job's own start)
    steps: int  # optimizer steps in the interval
    step_s: float  # mean wall time per step
    comm_wait_s: float  # mean time per step blocked on gradient collectives
    step: Optional[int] = None  # the interval's last step
    warming: bool = False  # some step was reduced densely by a compressor still in its warm-up
    refused: str = ""  # why the engine refused the setting `setting_id` names (the old one goes on)

    def metrics(self) -> Dict[str, float]:
        """The interval as metrics (MLflow's compression_id shows when the setting changed)."""
        return {"compression_id": self.setting_id, "interval_steps": self.steps,
                "interval_step_s": self.step_s, "interval_comm_s": self.comm_wait_s}

    def to_json(self) -> Dict[str, Any]:
        extra = {k: v for k, v in (("warming", self.warming), ("refused", self.refused)) if v}
        return {"step": self.step, **self.metrics(), **extra}


@dataclass(frozen=True)
class Event(Record):
    """Something a worker wants the run's events to say (how a group resumed, say)."""

    kind: ClassVar[str] = "event"
    text: str
    step: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return {"step": self.step, "event": self.text}


def as_record(obj: Any, world_size: Optional[int] = None) -> Record:
    """What `ctx.report` accepts: a mapping as Metrics of a group of `world_size`, a Metrics
    record with that world_size added where it has none, any other Record as it is."""
    if isinstance(obj, Mapping):
        return obj if isinstance(obj, Metrics) and (world_size is None or "world_size" in obj) \
            else Metrics(obj, world_size)
    if isinstance(obj, Record):
        return obj
    raise TypeError(f"ctx.report: expected a dict of metrics or a Record, got {type(obj).__name__}")
