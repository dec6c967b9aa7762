"""What a training function running on a worker sees: its group, and a line to the driver.

The training function is `fn(ctx)`, called on every worker of a group each time the group
(re)forms. It must resume from the newest committed checkpoint under `ctx.storage_path`: the
driver re-runs it after every membership change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from hybrid_ray.engine import Topology

from .records import Record, as_record


class StopTraining(Exception):
    """Raised inside a training function to end it at a stop request (ctx.agree_to_stop())."""


@dataclass
class WorkerContext:
    """topology: this worker's place in the current group (process group already formed).
    generation: how many times the group has been formed before this one (0 first).
    storage_path/run_name: where the run keeps checkpoints; the same on every worker.
    """

    topology: Topology
    generation: int
    storage_path: str
    run_name: str
    _report: Callable[[Record], None] = field(repr=False, default=lambda rec: None)
    _beat: Callable[[int], None] = field(repr=False, default=lambda step: None)
    _stop: Callable[[], bool] = field(repr=False, default=lambda: False)
    _directive: Callable[[], Optional[dict]] = field(repr=False, default=lambda: None)
    _flush: Callable[[float], bool] = field(repr=False, default=lambda timeout_s: True)

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def report(self, record: Union[Mapping[str, Any], Record]) -> None:
        """Send a record to the driver: a dict of metrics (JSON-able values, `step` among them;
        it travels as records.Metrics with this group's world_size) or a typed Record."""
        self._report(as_record(record, self.world_size))

    def flush_reports(self, timeout_s: float = 60.0) -> bool:
        """Block until the driver has received every record this worker reported; False if some
        had not arrived after timeout_s (the driver may be gone). Call it before saving a
        checkpoint: a worker lost after the checkpoint then loses no record of a step the
        resumed run will not do again, so every step's record reaches the driver."""
        return self._flush(timeout_s)

    def step_done(self, step: int) -> None:
        """Tell the driver this rank finished optimizer step `step` (its heartbeat)."""
        self._beat(int(step))

    def agree_to_stop(self) -> bool:
        """Collective: True on every rank when any rank saw a stop request."""
        flag = torch.tensor([1.0 if self._stop() else 0.0], device=self.topology.device)
        if self.topology.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.topology.group)
        return bool(flag.item() > 0)

    def agree_on_directive(self) -> Optional[dict]:
        """Collective: the newest directive rank 0 has from the driver (e.g. a gradient
        compression setting: {"id", "setting", "reason"}), the same on every rank; None before
        the first. Every rank calls it at the same step and applies what it returns before its
        next step, so a change takes effect at one step everywhere although the driver's message
        reaches the workers at different moments."""
        box = [self._directive() if self.rank == 0 else None]
        if self.topology.group is not None:
            dist.broadcast_object_list(box, src=0, group=self.topology.group,
                                       device=self.topology.device)
        return box[0]


_WARMED: dict = {}


def warmed() -> dict:
    """What a training function's warm() prepared on a warm spare while it waited (a model, say),
    kept in the worker's process for the generation the spare joins: the function takes it from
    here when it runs (a function is unpickled anew for each call, so it cannot keep it itself)."""
    return _WARMED


def local_context(storage_path: str, run_name: str, topology: Optional[Topology] = None) -> WorkerContext:
    """A context for running a training function without Ray (tests, torchrun)."""
    return WorkerContext(topology or Topology.from_environment(), 0, storage_path, run_name)
