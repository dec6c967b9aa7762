"""jobs/train_lm.py end to end: data preparation, torchrun re-launch with 2 gloo ranks,
checkpoints, a resume on another number of processes, exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_lm_job import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def run_job(tmp_path: Path, job: dict, *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"  # rank 0 records the run
    return subprocess.run([sys.executable, "jobs/train_lm.py", "--config", str(path), *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_two_ranks_train_then_resume_on_one(tmp_path, monkeypatch):
    # MLflow resolves a run's model artifacts through the process's tracking URI, not the client's.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    # ZeRO-3: every forward all-gathers, so evaluation (17 windows: 9 and 8 per rank) and
    # sampling must keep the ranks' forward calls in step.
    job = tiny_job(tmp_path / "data", tmp_path / "run", steps=20, save_interval=10, eval_interval=10,
                   eval_samples=17)
    job["engine"]["zero_optimization"]["stage"] = 3
    proc = run_job(tmp_path, job, "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prepared " in proc.stdout and proc.stdout.index("prepared ") < proc.stdout.index("launching")
    assert "2 process(es) on cpu (gloo)" in proc.stdout
    assert "batch 16 = 8 micro x 1 accumulation x 2 ranks" in proc.stdout
    assert "final: train loss" in proc.stdout and "done in" in proc.stdout and "sample (" in proc.stdout
    assert proc.stdout.count("final:") == 1  # rank 0 prints, rank 1 does not
    assert "eval  step 10: val loss" in proc.stdout
    # One process continues the two-process run: same global batch, twice the accumulation,
    # and the sample stream picks up at 20 steps x 16 samples.
    job["train"]["steps"] = 30
    proc = run_job(tmp_path, job, "--nproc", "1", "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "global_step20 at step 20; data epoch 0, sample 320 of" in proc.stdout
    assert f"run run: resuming from its checkpoint at step 20 of 30 ({tmp_path}/run/checkpoints)" in proc.stdout
    assert "batch 16 = 8 micro x 2 accumulation x 1 ranks" in proc.stdout
    assert "step    30/30" in proc.stdout and "step    10/" not in proc.stdout
    # Both launches recorded one MLflow run (rank 0, the Ray job's layout), continued by the resume.
    from mlflow import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
    run = runs[0].info.run_id
    assert [m.step for m in client.get_metric_history(run, "train/loss")] == [10, 20, 30]
    assert runs[0].data.tags["hybrid_ray.sessions"] == "2" and runs[0].data.params["launch.nproc"] == "2"
    assert [f.path for f in client.list_artifacts(run, "weights")] == ["weights/model.safetensors"]
    # Each launch that finished logged its model: the first at step 20, the resumed one at 30.
    models = client.search_logged_models([runs[0].info.experiment_id])
    assert sorted(m.name for m in models) == ["model", "model"], models
    assert {m.source_run_id for m in models} == {run}
    assert f"MLflow: run {run} (run)" in proc.stdout


def test_failure_in_a_rank_exits_1_with_a_message(tmp_path):
    job = tiny_job(tmp_path / "data", steps=1, require_below_baseline=True)
    proc = run_job(tmp_path, job, "--nproc", "2")  # one step cannot beat the unigram baseline
    assert proc.returncode == 1
    assert "training failed: DidNotLearnError: final val loss" in proc.stderr
    assert "error: training failed (torchrun exit code" in proc.stderr
    from mlflow import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FAILED"]  # the run says how it ended


def test_bad_job_file_or_data_source_exits_2_before_any_process(tmp_path):
    job = tiny_job(tmp_path / "data")
    job["engine"]["train_batch_size"] = 15  # 2 ranks cannot split 15 samples
    proc = run_job(tmp_path, job, "--nproc", "2")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr.startswith("error: engine.train_batch_size: train_batch_size 15 is not "
                                  "divisible by 2 data-parallel ranks")
    job = tiny_job(tmp_path / "data2")
    job["data"]["corpus"]["source"] = str(tmp_path / "absent")
    proc = run_job(tmp_path, job, "--nproc", "2")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert "absent: not a folder" in proc.stderr


def _losses(stdout: str) -> list:
    return [line.split("| loss ")[1].split(" ")[0] for line in stdout.splitlines() if line.startswith("step ")]


def test_tensor_parallel_job_matches_the_plain_one_and_resumes_unsplit(tmp_path):
    # fp32, so the printed losses (4 decimals) of T=2 x dp 2 and of dp 2 alone agree
    job = tiny_job(tmp_path / "data", tmp_path / "tp", steps=20, save_interval=10, eval_interval=10)
    job["engine"]["bf16"]["enabled"] = False
    plain = run_job(tmp_path, job, "--nproc", "2")
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    job["engine"]["tensor_model_parallel_size"] = 2
    job["train"]["out_dir"] = str(tmp_path / "tp2")
    split = run_job(tmp_path, job, "--nproc", "4")
    assert split.returncode == 0, split.stdout[-3000:] + split.stderr[-3000:]
    assert "4 process(es) (tensor 2 x pipeline 1 per replica)" in split.stdout
    assert "batch 16 = 8 micro x 1 accumulation x 2 ranks" in split.stdout and "sample (" in split.stdout
    assert _losses(split.stdout) == _losses(plain.stdout) and len(_losses(plain.stdout)) == 2
    # its checkpoint, saved split, resumes on one unsplit process
    job["engine"]["tensor_model_parallel_size"] = 1
    job["train"]["steps"] = 30
    resumed = run_job(tmp_path, job, "--nproc", "1", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "global_step20 at step 20" in resumed.stdout and "step    30/30" in resumed.stdout


def run_file(tmp_path: Path, job_file: str, *flags: str) -> subprocess.CompletedProcess:
    """A job file of jobs/configs as a user runs it, shortened (`flags`: --steps, --set)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"
    return subprocess.run([sys.executable, "jobs/train_lm.py", "--config", job_file, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)


def test_the_tensor_and_pipeline_job_file_at_eight_processes_trains_as_two_and_resumes_whole(tmp_path):
    """jobs/configs/tp2_pp2_cpu.json: (T, P, dp) = (2, 2, 2) on 8 gloo processes; in fp32 its
    printed losses are those of (1, 2, 1) on 2; its checkpoint resumes on one process at
    (1, 1, 1), and its exported model is the plain GPT's."""
    common = ["--steps", "20", "--set", f"data.path={tmp_path / 'data'}",
              "--set", "data.corpus.max_bytes=200000", "--set", "engine.bf16.enabled=false",
              "--set", "train.require_below_baseline=false"]
    split = run_file(tmp_path, "jobs/configs/tp2_pp2_cpu.json", "--nproc", "8", *common,
                     "--set", f"train.out_dir={tmp_path / 'split'}")
    assert split.returncode == 0, split.stdout[-3000:] + split.stderr[-3000:]
    assert "8 process(es) (tensor 2 x pipeline 2 per replica) on cpu (gloo)" in split.stdout
    assert "batch 16 = 4 micro x 2 accumulation x 2 ranks" in split.stdout
    assert "eval  step 10: val loss" in split.stdout and "sample: none drawn" in split.stdout
    staged = run_file(tmp_path, "jobs/configs/tp2_pp2_cpu.json", "--nproc", "2", *common,
                      "--set", "engine.tensor_model_parallel_size=1",
                      "--set", f"train.out_dir={tmp_path / 'staged'}")
    assert staged.returncode == 0, staged.stdout[-3000:] + staged.stderr[-3000:]
    assert "batch 16 = 4 micro x 4 accumulation x 1 ranks" in staged.stdout
    assert _losses(split.stdout) == _losses(staged.stdout) and len(_losses(split.stdout)) == 4
    # The exported model has the GPT's names and loads into it whole.
    from safetensors.torch import load_file
    from hybrid_ray.models import GPT, GPTConfig
    state = load_file(str(tmp_path / "split" / "model" / "model.safetensors"))
    gpt = GPT(GPTConfig(n_layer=4, n_head=4, d_model=64, vocab_size=state["wte.weight"].shape[0], seq_len=64))
    gpt.load_state_dict(state, strict=True)
    # The pipelined run's checkpoint resumes on one process, the PipelineModule whole.
    whole = run_file(tmp_path, "jobs/configs/tp2_pp2_cpu.json", "--nproc", "1", "--resume", *common,
                     "--set", "engine.tensor_model_parallel_size=1",
                     "--set", "engine.pipeline_model_parallel_size=1",
                     "--set", "train.steps=30", "--set", "engine.scheduler.params.total_num_steps=30",
                     "--set", f"train.out_dir={tmp_path / 'split'}")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "global_step20 at step 20" in whole.stdout and "step    30/30" in whole.stdout
    assert "1 process(es) on cpu" in whole.stdout and "sample (" in whole.stdout
