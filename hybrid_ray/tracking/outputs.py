"""What a run takes in and gives out, beyond numbers: its dataset (an MLflow dataset input), the
model it made (an MLflow 3 LoggedModel), and the source commit it ran from.

Sending is safe to repeat: the LoggedModel's id is recorded before anything is uploaded into
it, so a retry (or the next session, from the journal) fills the same model; a dataset input
MLflow already holds for the run is not added again.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Callable, Dict, Optional

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelOutput, LoggedModelStatus
from mlflow.models import Model
from mlflow.models.model import MLMODEL_FILE_NAME
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME

from . import ops
from .run import RunState


def send_model(client: MlflowClient, state: RunState, item: ops.Model,
               record: Callable[[int, str], None]) -> None:
    """Create the LoggedModel (once: record(seq, id) keeps its id), upload the saved model into
    it, mark it READY and link it to the run as an output at item.step."""
    if item.model_id is None:
        made = client.create_logged_model(state.experiment_id, name=item.name,
                                          source_run_id=state.run_id, params=item.params or None,
                                          model_type=item.model_type)
        item.model_id = made.model_id
        record(item.seq, made.model_id)
    logged = client.get_logged_model(item.model_id)
    # The MLmodel file names its model and run, as mlflow.<flavor>.log_model writes it.
    mlmodel = Model.load(os.path.join(item.local_path, MLMODEL_FILE_NAME))
    mlmodel.model_id = mlmodel.model_uuid = item.model_id
    mlmodel.run_id, mlmodel.artifact_path = state.run_id, logged.artifact_location
    mlmodel.save(os.path.join(item.local_path, MLMODEL_FILE_NAME))
    client.log_model_artifacts(item.model_id, item.local_path)
    if logged.status != LoggedModelStatus.READY:
        client.finalize_logged_model(item.model_id, LoggedModelStatus.READY)
    outputs = client.get_run(state.run_id).outputs
    if item.model_id not in {o.model_id for o in (outputs.model_outputs if outputs else [])}:
        client.log_outputs(state.run_id, [LoggedModelOutput(item.model_id, item.step)])


def send_dataset(client: MlflowClient, state: RunState, item: ops.Dataset) -> None:
    """Log the dataset as the run's input (MLflow keeps one per name and digest and context)."""
    inputs = client.get_run(state.run_id).inputs
    for held in (inputs.dataset_inputs if inputs else []):
        context = {t.key: t.value for t in held.tags}.get(MLFLOW_DATASET_CONTEXT)
        if (held.dataset.name, held.dataset.digest, context) == (item.name, item.digest, item.context):
            return
    dataset = Dataset(item.name, item.digest, item.source_type, item.source, item.schema, item.profile)
    client.log_inputs(state.run_id, [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, item.context)])])


def dataset_item(name: str, source: str, digest: str, profile: Optional[str] = None,
                 context: str = "training") -> ops.Dataset:
    """The Dataset item for data at `source` (a path or URI): MLflow's own source type for it."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    try:
        with warnings.catch_warnings():  # "can be interpreted in multiple ways": all the same class
            warnings.simplefilter("ignore", UserWarning)
            source_type = resolve_dataset_source(source)._get_source_type()
    except Exception:  # noqa: BLE001 - a URI scheme MLflow has no source class for
        source_type = "external"
    return ops.Dataset(name, digest, source_type, source, context, profile=profile)


def source_tags(root: Optional[str] = None) -> Dict[str, str]:
    """mlflow.source.git.commit and mlflow.source.name for the git checkout at `root` (default:
    the one this package runs from); {} when it is not a checkout (Ray's copy of the working
    dir has no .git) or git is missing: no tag rather than a wrong one."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, ".git")):
        return {}
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return {MLFLOW_GIT_COMMIT: commit, MLFLOW_SOURCE_NAME: script if os.path.isfile(script) else root}
