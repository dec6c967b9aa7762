"""What MLflow already holds for a run name, asked before a run starts: a resubmission that
found no checkpoint must not silently log a run from step 0 over one that has progress."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

from .run import RUN_NAME_TAG, SYSTEM_PREFIX, find_runs


@dataclass(frozen=True)
class Prior:
    """The MLflow run a run name already has."""

    run_id: str
    last_step: int
    """The largest training step it logged (system metrics and event counts aside)."""
    status: str


def prior_run(tracking_uri: str, experiment: str, run_name: str,
              timeout_s: int = 10) -> Optional[Prior]:
    """The run named run_name in experiment, or None. Raises the client's error when the
    store cannot be reached (the caller decides whether to go on)."""
    from mlflow import MlflowClient

    from .tracker import _client_defaults

    _client_defaults(timeout_s)
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = find_runs(client, exp.experiment_id, run_name, max_results=1)
    if not found:
        return None
    run = found[0]
    steps = [m.step for m in getattr(run.data, "_metric_objs", [])
             if not m.key.startswith((SYSTEM_PREFIX, "events/"))]
    return Prior(run.info.run_id, max(steps, default=0), run.info.status)


def retire(tracking_uri: str, prior: Prior, run_name: str) -> str:
    """Take the run name off an old run (kept, renamed `<name>.replaced-<UTC time>`, ended
    KILLED if it still says RUNNING) so that a restarted run gets a run of its own."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    new_name = f"{run_name}.replaced-{stamp}"
    client.set_tag(prior.run_id, RUN_NAME_TAG, new_name)
    client.set_tag(prior.run_id, "mlflow.runName", new_name)
    if prior.status == "RUNNING":
        client.set_terminated(prior.run_id, "KILLED")
    return new_name
