"""Where a (re)submitted run starts, said before anything trains: from its newest checkpoint,
from step 0 as a new run, or not at all when that would silently start over a run that MLflow
shows with progress (the run folder moved, or was deleted) and `--restart` was not given."""
from __future__ import annotations

import os
from typing import Callable, Optional

from hybrid_ray.config import ConfigError
from hybrid_ray.engine.checkpoint import read as cread
from hybrid_ray.engine.checkpoint import storage as cio
from hybrid_ray.lm.job import Job
from hybrid_ray.lm.placement import spool_dir
from hybrid_ray.lm.setup import checkpoint_dir


def run_name(job: Job) -> str:
    """The run's name: its run folder's, else the job file's (a run without a folder)."""
    out = job.train.out_dir
    if out:
        return os.path.basename(out.rstrip("/"))
    return os.path.splitext(os.path.basename(job.path))[0] or "lm"


def newest_step(checkpoints: Optional[str]) -> Optional[int]:
    """The step of the checkpoint a resume loads first (`latest`'s), None when there is none."""
    if checkpoints is None:
        return None
    fs, root = cio.filesystem(checkpoints)
    if not cio.is_dir(fs, root):
        return None
    first = cread.preferred(fs, root)
    return first.step if first else None


def starting_step(job: Job, name: str, resuming: bool, restart: bool,
                  say: Callable[[str], None] = print) -> int:
    """Say where run `name` starts and return that step; ConfigError (exit 2) when it would
    restart over an MLflow run with progress without --restart."""
    ckpt = checkpoint_dir(job)
    step = newest_step(ckpt) if resuming else None
    if step is not None and step >= job.train.steps:
        say(f"run {name}: already complete: its checkpoint at step {step} is the last "
            f"(train.steps {job.train.steps}); evaluating the final model only")
        return step
    if step is not None:
        say(f"run {name}: resuming from its checkpoint at step {step} of {job.train.steps} ({ckpt})")
        return step
    _check_mlflow(job, name, ckpt, restart, say)
    where = f"no checkpoint in {ckpt}" if resuming and ckpt else "not resuming"
    say(f"run {name}: starting from step 0 ({where})")
    return 0


def _check_mlflow(job: Job, name: str, ckpt: Optional[str], restart: bool,
                  say: Callable[[str], None]) -> None:
    if not job.tracking.enabled:
        return
    from hybrid_ray.tracking.lookup import prior_run, retire
    from hybrid_ray.tracking.tracker import DEFAULT_TRACKING_URI

    uri = job.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        return  # no database yet: no earlier run (and none is made just to ask)
    try:
        prior = prior_run(uri, job.tracking.experiment, name)
    except Exception as exc:  # noqa: BLE001 - an unreachable server must not stop the run
        say(f"warning: could not ask MLflow ({uri}) about an earlier run named {name}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}")
        return
    if prior is None or prior.last_step <= 0:
        return
    if not restart:
        raise ConfigError(
            f"run {name}: MLflow run {prior.run_id} of this name is at step {prior.last_step}, "
            f"but {ckpt or 'the run (train.out_dir is null)'} holds no checkpoint to resume from "
            f"(another --storage than before? a deleted run folder?); pass --restart to start "
            f"over from step 0 (the old MLflow run is kept, renamed), or choose another "
            f"--run-name", "--restart")
    renamed = retire(uri, prior, name)
    say(f"run {name}: --restart: the earlier MLflow run {prior.run_id} (step "
        f"{prior.last_step}) is kept as {renamed}; this one starts from step 0")
    _set_spool_aside(job, name, renamed, say)


def _set_spool_aside(job: Job, name: str, renamed: str, say: Callable[[str], None]) -> None:
    """What the old run left unsent belongs to it, not to the run that starts over."""
    spool = spool_dir(name, job.train.out_dir)
    if os.path.isdir(spool):
        aside = f"{spool}.{renamed.rsplit('.', 1)[-1]}"
        os.rename(spool, aside)
        say(f"run {name}: --restart: the earlier run's unsent MLflow records are kept in {aside}")
