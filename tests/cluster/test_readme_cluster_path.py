"""The README's cluster commands from a user's seat: a fresh clone in a temporary folder,
`infra/setup.sh`, then the block under "On a Ray cluster" run as written in a shell that has
activated nothing (PATH without the venv), with a short `--steps`: start the local cluster,
`ray job submit`, stop the job mid-run, submit the same command again. The second submission
resumes from the first one's checkpoint and says so; MLflow holds one run of that name, KILLED
after the stop and FINISHED at the end, with every logged step exactly once and the logged
model; each progress line is printed once, without colour codes."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.cluster.test_local_cluster_script import HOST, dashboard_missing, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 100  # as the README shows: small_cpu.json scaled, checkpoints every 33 steps
SAVE = 33


def readme_commands() -> list[str]:
    """The shell lines of the README's "On a Ray cluster" block, continuations joined."""
    text = (REPO / "README.md").read_text()
    section = text.split("## On a Ray cluster", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def _bare_env(state: Path) -> dict:
    ray_port, dashboard, agent, mlflow_port, client = free_ports(5)
    env = {"HOME": os.environ["HOME"], "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "HR_STATE_DIR": str(state), "HR_RAY_PORT": str(ray_port),
           "HR_DASHBOARD_PORT": str(dashboard), "HR_AGENT_PORT": str(agent),
           "HR_MLFLOW_PORT": str(mlflow_port), "HR_NUM_CPUS": "3", "HR_START_TIMEOUT": "180"}
    if importlib.util.find_spec("grpc") is not None:
        env["HR_CLIENT_PORT"] = str(client)
    for key in ("TMPDIR", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _shell(lines: list[str], env: dict, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -e\n" + "\n".join(lines)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _mlflow_run(uri: str, name: str):
    from mlflow import MlflowClient
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("hybrid_ray")
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], f"tags.`hybrid_ray.run_name` = '{name}'")
    return client, runs


@pytest.fixture
def clone():
    missing = dashboard_missing()
    if missing:
        pytest.skip(f"Ray's dashboard packages are missing ({missing})")
    base = Path(tempfile.mkdtemp(prefix="hr-readme-", dir="/tmp"))  # short: Ray's socket paths
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(base / "repo")], check=True)
    yield base
    env = _bare_env(base / "s")
    subprocess.run(["bash", "infra/local_cluster.sh", "stop"], cwd=base / "repo", timeout=120,
                   env={**env, "HR_STATE_DIR": str(base / "s")}, capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


def test_the_readme_cluster_commands_resume_a_stopped_job(clone):
    repo, env = clone / "repo", _bare_env(clone / "s")
    setup_and_start, activate, submit, stop = readme_commands()
    assert setup_and_start == "infra/setup.sh && infra/local_cluster.sh start"
    assert activate == 'eval "$(infra/local_cluster.sh env)"' and stop == "infra/local_cluster.sh stop"
    assert submit.startswith("ray job submit --working-dir . -- python jobs/train_lm.py")
    submit = re.sub(r"--steps \d+", f"--steps {STEPS}", submit)

    started = _shell([setup_and_start], env, repo)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    uri = f"http://{HOST}:{env['HR_MLFLOW_PORT']}"

    first = subprocess.Popen(["bash", "-c", f"set -e\n{activate}\n{submit}"], env=env, cwd=repo,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job_id, lines = _follow_until_checkpoint(first, repo / "runs" / "small_cpu" / "checkpoints")
    stopped = _shell([activate, f"ray job stop {job_id}"], env, repo, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    first.wait(120)
    client, runs = _wait_for_status(uri, "KILLED")
    assert len(runs) == 1, runs

    second = _shell([activate, submit], env, repo)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    resumed = re.search(rf"run small_cpu: resuming from its checkpoint at step (\d+) of {STEPS}", out)
    assert resumed and int(resumed.group(1)) in (SAVE, 2 * SAVE), out[-4000:]
    assert f"done: {STEPS} steps" in out, out[-4000:]
    ours = [line for line in out.splitlines() if line.startswith(("step ", "eval step", "run ",
                                                                  "(Worker", "done:", "MLflow:"))]
    assert ours and not [line for line in ours if "\x1b[" in line], ours  # no colour codes
    assert "View run" not in out, out[-3000:]  # MLflow's own lines: the job says it once
    step_lines = Counter(line.split("|")[0].strip() for line in out.splitlines()
                         if line.startswith("step "))
    assert step_lines and max(step_lines.values()) == 1, step_lines  # each progress line once

    client, runs = _mlflow_run(uri, "small_cpu")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
    run_id = runs[0].info.run_id
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.timestamp)
    assert [m.step for m in history] == list(range(5, STEPS + 1, 5))  # every point, once, in order
    models = client.search_logged_models([runs[0].info.experiment_id])
    assert [m.source_run_id for m in models] == [run_id], models
    assert f"MLflow: run {run_id} (small_cpu): {uri}/#/experiments/" in out, out[-2000:]
    assert _shell([stop], env, repo, timeout=120).returncode == 0


def _follow_until_checkpoint(proc: subprocess.Popen, checkpoints: Path):
    """Read the first submission's output (a thread: the pipe must not fill) until its first
    checkpoint is committed; the job id and the output lines so far."""
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 900
    while not (checkpoints / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.2)
    found = re.search(r"Job '(raysubmit_\w+)' submitted successfully", "".join(lines))
    assert found, "".join(lines)[-4000:]
    return found.group(1), lines


def _wait_for_status(uri: str, status: str):
    deadline = time.monotonic() + 60
    while True:
        client, runs = _mlflow_run(uri, "small_cpu")
        if runs and runs[0].info.status == status:
            return client, runs
        assert time.monotonic() < deadline, [r.info.status for r in runs]
        time.sleep(0.5)
