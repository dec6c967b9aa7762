"""Packing queued items into one MlflowClient.log_batch call, within MLflow's batch limits.

The plan is computed against the run's state without changing it; the sender applies the plan's
updates only once the batch is acknowledged, so a failed batch is retried as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from mlflow.entities import Metric, Param, RunTag
from mlflow.utils.validation import (MAX_ENTITIES_PER_BATCH, MAX_METRICS_PER_BATCH,
                                     MAX_PARAMS_TAGS_PER_BATCH)

from . import ops
from .run import COUNT_PREFIX, RunState
from .values import tag_value

LAST_EVENT_TAG = "hybrid_ray.last_event"
PARAM_CHANGED_PREFIX = "param_changed."  # tag: a param whose value changed on resumption


@dataclass
class Plan:
    taken: int = 0
    """Queue items the batch covers."""
    metrics: List[Metric] = field(default_factory=list)
    params: List[Param] = field(default_factory=list)
    tags: Dict[str, str] = field(default_factory=dict)
    last_step: Dict[str, int] = field(default_factory=dict)
    new_params: Dict[str, str] = field(default_factory=dict)
    event_counts: Dict[str, int] = field(default_factory=dict)
    event_lines: List[str] = field(default_factory=list)
    replayed: int = 0

    @property
    def tag_entities(self) -> List[RunTag]:
        return [RunTag(k, v) for k, v in self.tags.items()]

    def apply(self, state: RunState) -> None:
        """The batch was acknowledged: the run now holds it."""
        for k, step in self.last_step.items():
            state.last_step[k] = max(step, state.last_step.get(k, step))
        state.params.update(self.new_params)
        state.event_counts.update(self.event_counts)
        state.event_lines.extend(self.event_lines)


def _bound(item) -> tuple:
    """Upper bounds of (metrics, params, tags) an item adds."""
    if isinstance(item, ops.Params):
        return 0, item.size, item.size  # each param may turn into a param_changed tag
    if isinstance(item, ops.Tags):
        return 0, 0, item.size
    if isinstance(item, ops.Event):
        return item.size, 0, 1
    return item.size, 0, 0


def plan_batch(items: Sequence, state: RunState) -> Plan:
    """Plan a batch for the leading batchable items (at least one, if the first is batchable)."""
    plan, m, p, t = Plan(), 0, 0, 0
    for item in items:
        if not isinstance(item, ops.BATCHED):
            break
        dm, dp, dt = _bound(item)
        fits = (m + dm <= MAX_METRICS_PER_BATCH and p + dp <= MAX_PARAMS_TAGS_PER_BATCH
                and t + dt <= MAX_PARAMS_TAGS_PER_BATCH and m + dm + p + dp + t + dt <= MAX_ENTITIES_PER_BATCH)
        if plan.taken and not fits:
            break
        m, p, t = m + dm, p + dp, t + dt
        _add(plan, item, state)
        plan.taken += 1
    return plan


def _add(plan: Plan, item, state: RunState) -> None:
    if isinstance(item, ops.Metrics):
        _add_metrics(plan, item, state)
    elif isinstance(item, ops.SystemMetrics):
        _add_system(plan, item, state)
    elif isinstance(item, ops.Params):
        _add_params(plan, item, state)
    elif isinstance(item, ops.Tags):
        plan.tags.update(item.items)
    elif isinstance(item, ops.Event):
        _add_event(plan, item, state)


def _add_metrics(plan: Plan, item: ops.Metrics, state: RunState) -> None:
    for key, value, step, ts in item.items:
        last = plan.last_step.get(key, state.last_step.get(key))
        if item.monotonic and last is not None and step <= last:
            plan.replayed += 1  # a step logged again after a recovery: the run keeps the first
            continue
        plan.metrics.append(Metric(key, value, ts, step))
        plan.last_step[key] = step if last is None else max(step, last)


def _add_system(plan: Plan, item: ops.SystemMetrics, state: RunState) -> None:
    for key, value in item.values.items():
        step = state.system_step + item.index
        last = plan.last_step.get(key, state.last_step.get(key))
        if last is not None and step <= last:
            # Samples of an earlier session replayed from the journal took these steps: the
            # series goes on after them rather than logging two values at one step.
            step = last + 1
        plan.metrics.append(Metric(key, value, item.timestamp, step))
        plan.last_step[key] = step


def _add_params(plan: Plan, item: ops.Params, state: RunState) -> None:
    for key, value in item.items.items():
        known = plan.new_params.get(key, state.params.get(key))
        if known is None:
            plan.params.append(Param(key, value))
            plan.new_params[key] = value
        elif known != value:
            # MLflow refuses to change a param; a resumed job with a new value records it here.
            plan.tags[PARAM_CHANGED_PREFIX + key] = tag_value(value)


def _add_event(plan: Plan, item: ops.Event, state: RunState) -> None:
    count = plan.event_counts.get(item.kind, state.event_counts.get(item.kind, 0)) + 1
    plan.event_counts[item.kind] = count
    plan.metrics.append(Metric(COUNT_PREFIX + item.kind, float(count), item.timestamp, item.step))
    plan.metrics += [Metric(f"events/{k}", v, item.timestamp, item.step) for k, v in item.values.items()]
    plan.tags[LAST_EVENT_TAG] = tag_value(item.text)
    plan.event_lines.append(item.line)
