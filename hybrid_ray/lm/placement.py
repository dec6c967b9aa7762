"""Where a run's files go: its run folder, its dataset and the embedded MLflow store.

The run folder is `<storage>/<run name>`: `--storage` (or the job file's `train.storage`) and
`--run-name`, each defaulting to the parent folder and the name of `train.out_dir`. The embedded
MLflow store (no `tracking.uri`, no MLFLOW_TRACKING_URI) is `<storage>/mlflow.db` beside the run
folders, so the records of a run live and move with its checkpoints.

Relative paths resolve against the directory the command was started from, except under
`ray job submit --working-dir`: there the entrypoint runs inside Ray's per-job copy of the
working directory, which a resubmission after any edit does not find and which goes with the
cluster session. Under such a job a relative run folder is refused unless `--storage` is an
absolute path or a URI; relative paths of the job file (`data.path`) then resolve against it,
so the dataset is built once and found again by every resubmission.
"""
from __future__ import annotations

import copy
import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from hybrid_ray.config.errors import config_error
from hybrid_ray.config.paths import is_uri

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for the entrypoint
DEFAULT_OUT_DIR = "runs/lm"


def job_working_copy(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The directory of Ray's copy of the submitter's working directory when this process is
    the entrypoint of a `ray job submit --working-dir` job (it runs there), else None."""
    environ = os.environ if environ is None else environ
    try:
        runtime_env = json.loads(environ.get(JOB_CONFIG_ENV) or "{}").get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return os.getcwd() if runtime_env.get("working_dir") else None


@dataclass(frozen=True)
class Placement:
    """The resolved places of one run."""

    storage: str
    """Parent of the run folder: an absolute path or a URI."""
    name: str
    """The run name: the run folder's name and the MLflow run's."""
    tracking_uri: Optional[str]
    """The job's tracking.uri, else the embedded store beside the run folders (None when
    MLFLOW_TRACKING_URI decides, or the storage is not local)."""

    @property
    def out_dir(self) -> str:
        return posixpath.join(self.storage, self.name) if is_uri(self.storage) \
            else os.path.join(self.storage, self.name)


def place(raw: Mapping[str, Any], storage: Optional[str] = None, run_name: Optional[str] = None,
          environ: Optional[Mapping[str, str]] = None, folder: bool = True) -> Dict[str, Any]:
    """The raw job with its run folder (train.out_dir), data.path and embedded MLflow store made
    absolute by the rules above; ConfigError (one line, naming the key) when a relative path
    has nothing stable to resolve against. folder=False: a job without out_dir, storage or
    run name keeps running without a run folder (torchrun allows that; Ray runs need one)."""
    environ = os.environ if environ is None else environ
    out = copy.deepcopy(dict(raw))
    train = dict(out.get("train") or {})
    data = dict(out.get("data") or {})
    tracking = dict(out.get("tracking") or {})
    copy_dir = job_working_copy(environ)
    if folder or storage or run_name or train.get("out_dir") or train.get("storage"):
        where = _placement(train, storage, run_name, copy_dir, tracking, environ)
        train["out_dir"], root, uri = where.out_dir, where.storage, where.tracking_uri
    else:
        root, uri = _absolute(".", "train.out_dir", copy_dir, "null"), None
    train.pop("storage", None)  # consumed: out_dir says it all now
    if isinstance(data.get("path"), str):
        data["path"] = _data_path(data["path"], root, copy_dir)
    if uri is not None:
        tracking["uri"] = uri
    out["train"], out["data"] = train, data
    if tracking:
        out["tracking"] = tracking
    return out


def _placement(train: Dict[str, Any], storage: Optional[str], run_name: Optional[str],
               copy_dir: Optional[str], tracking: Mapping[str, Any],
               environ: Mapping[str, str]) -> Placement:
    out_dir = str(train.get("out_dir") or DEFAULT_OUT_DIR).rstrip("/")
    key, root = ("--storage", storage) if storage else ("train.storage", train.get("storage"))
    if not root:  # the out_dir's parent, as before --storage existed
        key, root = "train.out_dir", posixpath.dirname(out_dir) or "."
    root = _absolute(str(root), key, copy_dir, out_dir)
    name = run_name or posixpath.basename(out_dir)
    if not name or name in (".", "..") or "/" in name:
        raise config_error("--run-name", "invalid", name, "allowed: a folder name (no '/')")
    uri = tracking.get("uri")
    if not uri and not environ.get("MLFLOW_TRACKING_URI") and not is_uri(root):
        uri = "sqlite:///" + os.path.join(root, "mlflow.db")
    elif isinstance(uri, str) and uri.startswith("sqlite:///") and not os.path.isabs(uri[10:]):
        # A relative database beside the run folders under a job, like the dataset.
        uri = "sqlite:///" + _data_path(uri[10:], root, copy_dir)
    return Placement(root, name, uri if uri != tracking.get("uri") else None)


def _absolute(path: str, key: str, copy_dir: Optional[str], shown: str) -> str:
    if is_uri(path) or os.path.isabs(path):
        return path.rstrip("/") if len(path) > 1 else path
    if copy_dir is not None:
        raise config_error(key, "relative path under `ray job submit`", shown,
                           f"it would resolve inside Ray's temporary copy of the working "
                           f"directory ({copy_dir}), which a resubmission does not find; allowed: "
                           f"--storage with an absolute path or a URI, e.g. --storage \"$PWD/runs\"")
    return os.path.abspath(path)


def _data_path(path: str, storage: str, copy_dir: Optional[str]) -> str:
    if is_uri(path) or os.path.isabs(path):
        return path
    if copy_dir is None:
        return os.path.abspath(path)
    return posixpath.join(storage, path) if is_uri(storage) else os.path.join(storage, path)


def spool_dir(name: str, out_dir: Optional[str]) -> str:
    """Where the run's MLflow records wait for the server: <out_dir>/mlflow beside the
    checkpoints, or (no run folder, or one on an object store) a folder of this host's cache;
    `hybrid-ray mlflow sync` takes either."""
    if out_dir and not is_uri(out_dir):
        return os.path.join(out_dir, "mlflow")
    return os.path.join(os.path.expanduser("~"), ".cache", "hybrid_ray", "mlflow-spool", name)
