"""Where a run's files go (hybrid_ray/lm/placement.py) and what a resubmission says and refuses
(hybrid_ray/lm/resubmit.py): relative paths under `ray job submit --working-dir` never land in
Ray's temporary copy of the working directory."""
from __future__ import annotations

import copy
import json
import os

import pytest

from hybrid_ray.config import ConfigError
from hybrid_ray.lm.job import load_job
from hybrid_ray.lm.placement import job_working_copy, place
from hybrid_ray.lm.resubmit import newest_step, starting_step
from tests.unit.test_lm_job import TINY

UNDER_JOB = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(
    {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {}})}


def raw(out_dir="runs/tiny", data="data/bytes"):
    r = copy.deepcopy(TINY)
    r["train"]["out_dir"] = out_dir
    r["data"]["path"] = data
    return r


def test_outside_a_job_relative_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    placed = place(raw(), environ={})
    assert placed["train"]["out_dir"] == str(tmp_path / "runs" / "tiny")
    assert placed["data"]["path"] == str(tmp_path / "data" / "bytes")
    # The embedded MLflow store lives beside the run folders, not in the working directory.
    assert placed["tracking"]["uri"] == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert "storage" not in placed["train"]
    load_job(placed)  # still a valid job


def test_storage_and_run_name_choose_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    placed = place(raw(), storage="elsewhere", run_name="exp-2", environ={})
    assert placed["train"]["out_dir"] == str(tmp_path / "elsewhere" / "exp-2")
    assert placed["tracking"]["uri"] == f"sqlite:///{tmp_path}/elsewhere/mlflow.db"
    r = raw()
    r["train"]["storage"] = "/srv/runs"
    assert place(r, environ={})["train"]["out_dir"] == "/srv/runs/tiny"
    assert place(r, storage="/mnt/x", environ={})["train"]["out_dir"] == "/mnt/x/tiny"  # flag wins
    placed = place(raw(), storage="s3://bucket/runs/", environ={})
    assert placed["train"]["out_dir"] == "s3://bucket/runs/tiny"
    assert "uri" not in placed.get("tracking", {})  # no sqlite on an object store


def test_the_tracking_uri_a_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "tracking" not in place(raw(), environ={"MLFLOW_TRACKING_URI": "http://h:5000"})
    r = raw()
    r["tracking"] = {"uri": "http://mlflow:5000"}
    assert place(r, environ={})["tracking"]["uri"] == "http://mlflow:5000"
    r["tracking"] = {"uri": "sqlite:///my.db"}
    assert place(r, environ={})["tracking"]["uri"] == f"sqlite:///{tmp_path}/my.db"


def test_a_run_without_a_folder_keeps_none_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = raw(out_dir=None)
    assert place(r, folder=False, environ={})["train"]["out_dir"] is None
    assert place(r, environ={})["train"]["out_dir"] == str(tmp_path / "runs" / "lm")


def test_under_a_ray_job_a_relative_run_folder_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert job_working_copy(UNDER_JOB) == str(tmp_path)
    assert job_working_copy({}) is None
    assert job_working_copy({"RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": {}}'}) is None
    with pytest.raises(ConfigError) as err:
        place(raw(), environ=UNDER_JOB)
    msg = str(err.value)
    assert msg.startswith("train.out_dir: relative path under `ray job submit`")
    assert str(tmp_path) in msg and '--storage "$PWD/runs"' in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"^--storage: relative path"):
        place(raw(), storage="runs", environ=UNDER_JOB)


def test_under_a_ray_job_relative_paths_resolve_against_the_storage():
    placed = place(raw(), storage="/home/me/repo/runs", environ=UNDER_JOB)
    assert placed["train"]["out_dir"] == "/home/me/repo/runs/tiny"
    assert placed["data"]["path"] == "/home/me/repo/runs/data/bytes"  # built once, found again
    assert placed["tracking"]["uri"] == "sqlite:////home/me/repo/runs/mlflow.db"
    placed = place(raw(), storage="s3://b/runs", environ={**UNDER_JOB, "MLFLOW_TRACKING_URI": "http://m"})
    assert placed["data"]["path"] == "s3://b/runs/data/bytes"
    absolute = place(raw(out_dir="/abs/runs/tiny", data="/abs/data"), environ=UNDER_JOB)
    assert absolute["train"]["out_dir"] == "/abs/runs/tiny" and absolute["data"]["path"] == "/abs/data"


def test_placing_twice_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    once = place(raw(), storage="s", run_name="n", environ={})
    assert place(once, environ={}) == once


def test_a_bad_run_name_is_one_line():
    with pytest.raises(ConfigError, match=r"^--run-name: invalid; got 'a/b'"):
        place(raw(), storage="/x", run_name="a/b", environ={})


def _job(tmp_path, name="tiny"):
    r = raw(out_dir=str(tmp_path / "runs" / name), data=str(tmp_path / "data"))
    r["tracking"] = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "placement-test"}
    return load_job(r)


def test_a_new_run_says_it_starts_from_step_0(tmp_path):
    said = []
    assert newest_step(str(tmp_path / "nothing")) is None
    assert starting_step(_job(tmp_path), "tiny", resuming=True, restart=False, say=said.append) == 0
    assert said == [f"run tiny: starting from step 0 (no checkpoint in {tmp_path}/runs/tiny/checkpoints)"]
    assert not (tmp_path / "mlflow.db").exists()  # asking made no database


@pytest.mark.slow
def test_a_run_name_with_mlflow_progress_but_no_checkpoint_is_refused_unless_restart(tmp_path):
    from mlflow import MlflowClient

    from hybrid_ray.tracking.run import RUN_NAME_TAG
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("placement-test")
    old = client.create_run(exp, run_name="tiny", tags={RUN_NAME_TAG: "tiny"}).info.run_id
    client.log_metric(old, "train/loss", 3.0, step=40)
    client.log_metric(old, "system/cpu_utilization_percentage", 3.0, step=900)
    with pytest.raises(ConfigError) as err:
        starting_step(_job(tmp_path), "tiny", resuming=True, restart=False, say=print)
    msg = str(err.value)
    assert f"MLflow run {old} of this name is at step 40" in msg and "--restart" in msg
    assert "\n" not in msg
    spool = tmp_path / "runs" / "tiny" / "mlflow"  # what the old run left unsent
    spool.mkdir(parents=True)
    (spool / "journal.jsonl").write_text("{}\n")
    said = []
    assert starting_step(_job(tmp_path), "tiny", resuming=True, restart=True, say=said.append) == 0
    assert "is kept as tiny.replaced-" in said[0] and said[2].startswith("run tiny: starting from step 0")
    assert not spool.exists() and "unsent MLflow records are kept in" in said[1]
    [aside] = (tmp_path / "runs" / "tiny").glob("mlflow.replaced-*")
    assert (aside / "journal.jsonl").read_text() == "{}\n"
    renamed = client.get_run(old)
    assert renamed.data.tags[RUN_NAME_TAG].startswith("tiny.replaced-")
    assert renamed.info.status == "KILLED"
    # The name is free now: asking again finds nothing and says nothing about MLflow.
    said.clear()
    starting_step(_job(tmp_path), "tiny", resuming=True, restart=False, say=said.append)
    assert len(said) == 1


def test_an_unreachable_tracking_server_warns_and_goes_on(tmp_path):
    r = raw(out_dir=str(tmp_path / "runs" / "t"), data=str(tmp_path / "data"))
    r["tracking"] = {"uri": "http://127.0.0.1:9"}  # the discard port: nothing listens
    said = []
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert starting_step(load_job(r), "t", resuming=True, restart=False, say=said.append) == 0
    assert said[0].startswith("warning: could not ask MLflow (http://127.0.0.1:9)")
