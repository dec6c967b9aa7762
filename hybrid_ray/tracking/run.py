"""One MLflow run per run name: find the run a previous driver made, or make it, and read back
what it already holds so a resumed session continues it instead of clashing with it.

A run is ours when its tag `hybrid_ray.run_name` equals the run name; a resubmitted job or a
restarted driver finds it there and goes on logging into it (a second run for the same job is
what Ray Train's MLflow callback makes, ray-project/ray#48664).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mlflow import MlflowClient
from mlflow.entities import RunStatus, ViewType
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

RUN_NAME_TAG = "hybrid_ray.run_name"
SESSIONS_TAG = "hybrid_ray.sessions"
EVENTS_FILE = "events.log"
COUNT_PREFIX = "events/count/"  # events/count/<kind>: running count of events of that kind
SYSTEM_PREFIX = "system/"
KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"  # MLflow 3's UI view


@dataclass
class RunState:
    """What the run holds, kept current by the sender as it logs."""

    run_id: str
    resumed: bool
    session: int
    """1 for the session that created the run, 2 for the first resumption, ..."""
    params: Dict[str, str] = field(default_factory=dict)
    last_step: Dict[str, int] = field(default_factory=dict)
    """Per metric key, the largest step logged (steps at or below it are replays)."""
    event_counts: Dict[str, int] = field(default_factory=dict)
    event_lines: List[str] = field(default_factory=list)
    system_step: int = 0
    """Next step for system metrics (MLflow's own monitor counts them from 0 per run)."""
    experiment_id: str = ""


def artifact_root(tracking_uri: str) -> Optional[str]:
    """Where a new experiment keeps its artifacts: beside a local SQLite database (MLflow's
    default, ./mlruns, is the working directory's wherever the database is); None: the store's
    own default (a tracking server decides)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = os.path.abspath(tracking_uri[len("sqlite:///"):])
    return os.path.join(os.path.dirname(database), "mlruns")


def experiment_id(client: MlflowClient, name: str, artifact_location: Optional[str] = None) -> str:
    """The experiment's id, made if missing. MLflow 3's UI opens an experiment without a kind
    in its GenAI view (traces, none here): an experiment of ours says it holds model training."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            exp = client.get_experiment(client.create_experiment(name, artifact_location))
        except MlflowException as exc:  # another driver created it in between
            if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            exp = client.get_experiment_by_name(name)
    if KIND_TAG not in exp.tags:  # a kind someone chose stays
        client.set_experiment_tag(exp.experiment_id, KIND_TAG, TRAINING_KIND)
    return exp.experiment_id


def find_runs(client: MlflowClient, exp_id: str, run_name: str, max_results: int = 5) -> list:
    """The active runs tagged with run_name in the experiment, oldest first (the first is the
    run's, should two drivers ever have raced to create it)."""
    return client.search_runs([exp_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
                              run_view_type=ViewType.ACTIVE_ONLY, max_results=max_results,
                              order_by=["attributes.start_time ASC"])


def open_run(client: MlflowClient, experiment: str, run_name: str,
             artifact_location: Optional[str] = None) -> RunState:
    """Continue the run named `run_name` in `experiment`, or create it (and the experiment,
    with its artifacts at `artifact_location`)."""
    exp_id = experiment_id(client, experiment, artifact_location)
    found = find_runs(client, exp_id, run_name)
    if not found:
        run = client.create_run(exp_id, run_name=run_name,
                                tags={RUN_NAME_TAG: run_name, SESSIONS_TAG: "1"})
        return RunState(run.info.run_id, resumed=False, session=1, experiment_id=exp_id)
    run = found[0]  # the oldest, should two drivers ever have raced to create it
    run_id = run.info.run_id
    session = int(run.data.tags.get(SESSIONS_TAG, "1")) + 1
    if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
        client.update_run(run_id, status="RUNNING")  # MLflow's system monitor stops otherwise
    client.set_tag(run_id, SESSIONS_TAG, str(session))
    state = RunState(run_id, resumed=True, session=session, params=dict(run.data.params),
                     experiment_id=exp_id)
    _read_metrics(run, state)
    state.event_lines = _read_events(client, run_id)
    return state


def _read_metrics(run, state: RunState) -> None:
    # RunData keeps, per key, the latest value at the largest step; `_metric_objs` is the only
    # place that step is exposed (MLflow's own system-metrics monitor reads it the same way),
    # and it spares fetching every key's whole history.
    for metric in getattr(run.data, "_metric_objs", []):
        state.last_step[metric.key] = metric.step
        if metric.key.startswith(COUNT_PREFIX):
            state.event_counts[metric.key[len(COUNT_PREFIX):]] = int(metric.value)
        if metric.key.startswith(SYSTEM_PREFIX):
            state.system_step = max(state.system_step, metric.step + 1)


def _read_events(client: MlflowClient, run_id: str) -> List[str]:
    """The lines of the run's events.log, so this session appends instead of overwriting."""
    if EVENTS_FILE not in {os.path.basename(f.path) for f in client.list_artifacts(run_id)}:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, EVENTS_FILE, tmp)
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
