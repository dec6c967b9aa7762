"""The MLflow spool against a real `mlflow server` on loopback: what the server missed at the end
of a run (killed server, killed driver) is sent once and in order by `hybrid-ray mlflow sync` or
by the run's next start, and the run ends with the status it ended with; a logged model loads
back through MLflow's PyTorch flavour and can be registered.

One server for the module; tests kill it (SIGKILL, by pid) and start it again on the same port
and database.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from hybrid_ray.tracking import RunTracker
from hybrid_ray.tracking.sync import ENDED_BY_TAG, sync
from tests.cluster.test_mlflow_tracker import Server, _wait_sent, server  # noqa: F401 - server: a fixture

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def up(server):
    if server.proc is None:  # a failed test may have left it down
        server.start()
    return server


def _sync_cli(run_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "mlflow", "sync", str(run_dir)],
                          capture_output=True, text=True, env=env, timeout=120)


def _run(client: MlflowClient, name: str):
    exp = client.get_experiment_by_name("spool-test")
    runs = client.search_runs([exp.experiment_id], f"tags.`hybrid_ray.run_name` = '{name}'")
    assert len(runs) == 1
    return runs[0]


def _steps(client: MlflowClient, run_id: str, key: str) -> list:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _first_half(server: Server, name: str, run_dir: Path) -> RunTracker:
    """Steps 1-5 reach the server; then it dies and steps 6-10, a param, a tag, two files and the
    dataset input are only spooled."""
    tracker = RunTracker(name, experiment="spool-test", tracking_uri=server.uri, params={"lr": 0.1},
                         spool_dir=str(run_dir / "mlflow"), max_backoff_s=0.2)
    for step in range(1, 6):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    _wait_sent(tracker)
    server.kill()
    for step in range(6, 11):
        tracker.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step)
    tracker.log_params({"batch": 8})
    tracker.set_tags({"phase": "outage"})
    tracker.log_text("written while the server was down", "notes/outage.txt")
    data = run_dir / "data"
    data.mkdir()
    (data / "report.json").write_text('{"ok": true}')
    tracker.log_artifact(str(data / "report.json"), "reports")
    tracker.log_dataset("tokens", str(data), "d1g3st", {"train_tokens": 100})
    return tracker


def _check_second_half(client: MlflowClient, run, tmp_path: Path) -> None:
    run_id = run.info.run_id
    assert _steps(client, run_id, "loss") == list(range(1, 11))  # each step once
    assert _steps(client, run_id, "lr") == list(range(6, 11))
    assert run.data.params == {"lr": "0.1", "batch": "8"}
    assert run.data.tags["phase"] == "outage"
    out = tmp_path / "down"
    out.mkdir(exist_ok=True)
    assert Path(client.download_artifacts(run_id, "notes/outage.txt", str(out))).read_text() == \
        "written while the server was down"
    assert Path(client.download_artifacts(run_id, "reports/report.json", str(out))).read_text() == '{"ok": true}'
    (dataset,) = run.inputs.dataset_inputs
    assert (dataset.dataset.name, dataset.dataset.digest) == ("tokens", "d1g3st")
    assert {t.key: t.value for t in dataset.tags}["mlflow.data.context"] == "training"


@pytest.mark.parametrize("status", ["FINISHED", "FAILED"])
def test_sync_sends_what_a_dead_server_missed(up, tmp_path, caplog, status):
    caplog.set_level(logging.WARNING, logger="hybrid_ray.tracking")
    run_dir, name = tmp_path / "run", f"sync-{status.lower()}"
    tracker = _first_half(up, name, run_dir)
    started = time.monotonic()
    report = tracker.close(status, timeout_s=1.0)
    assert time.monotonic() - started < 5 and report.unsent > 0
    assert report.spooled_in == str(run_dir / "mlflow")
    warning = [r.getMessage() for r in caplog.records if "spooled" in r.getMessage()]
    assert len(warning) == 1 and f"`hybrid-ray mlflow sync {run_dir}`" in warning[0]
    assert list((run_dir / "mlflow" / "staged").glob("item-*/outage.txt"))  # kept until sent

    up.start()
    out = _sync_cli(run_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("sent ") and f"status {status}" in out.stdout
    client = MlflowClient(up.uri)
    run = _run(client, name)
    assert run.info.run_id in out.stdout and run.info.status == status
    _check_second_half(client, run, tmp_path)
    assert not list((run_dir / "mlflow" / "staged").glob("item-*"))  # uploaded: copies removed
    again = _sync_cli(run_dir)
    assert again.returncode == 0 and again.stdout.startswith("nothing to send")


def test_the_next_start_sends_what_a_dead_server_missed(up, tmp_path):
    run_dir, name = tmp_path / "run", "next-start"
    tracker = _first_half(up, name, run_dir)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    tracker.log_model(net, "net")  # saved into the spool now, a LoggedModel once sent
    assert tracker.close("FAILED", timeout_s=1.0).unsent > 0

    up.start()
    second = RunTracker(name, experiment="spool-test", tracking_uri=up.uri,
                        spool_dir=str(run_dir / "mlflow"), max_backoff_s=0.2)
    for step in range(9, 13):  # resumed from a checkpoint at step 8: 9 and 10 are replays
        second.log_metrics({"loss": 0.5 / step}, step)
    _wait_sent(second)
    client = MlflowClient(up.uri)
    run = _run(client, name)
    assert run.info.status == "RUNNING"  # the old session's FAILED is superseded
    second.close("FINISHED")
    run = _run(client, name)
    assert run.info.status == "FINISHED" and run.info.run_id == second.run_id
    assert [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                    key=lambda m: m.step)][8:] == [1 / 9, 1 / 10, 0.5 / 11, 0.5 / 12]
    assert _steps(client, run.info.run_id, "loss") == list(range(1, 13))
    run = client.get_run(run.info.run_id)
    (output,) = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.name == "net" and str(model.status) == "READY"


CHILD = textwrap.dedent("""
    import sys, time
    from hybrid_ray.tracking import RunTracker
    uri, spool = sys.argv[1], sys.argv[2]
    t = RunTracker("killed", experiment="spool-test", tracking_uri=uri, spool_dir=spool,
                   max_backoff_s=0.2)
    for step in range(1, 11):
        t.log_metrics({"loss": float(step)}, step)
    while t.pending:
        time.sleep(0.05)
    print("sent", flush=True)
    sys.stdin.readline()  # the server is killed now
    for step in range(11, 21):
        t.log_metrics({"loss": float(step)}, step)
    t.log_text("last words", "notes/last.txt")
    print("logged", flush=True)
    time.sleep(120)
""")


def test_sync_ends_a_sigkilled_run_killed(up, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, up.uri, str(run_dir / "mlflow")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "sent"
        up.kill()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "logged"
        refused = sync(str(run_dir))  # the writer is alive: its own tracker sends its records
        assert refused.code == 1 and f"pid {child.pid}" in refused.line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    down = _sync_cli(run_dir)
    assert down.returncode == 1 and "cannot be reached" in down.stderr and "nothing sent" in down.stderr

    up.start()
    out = _sync_cli(run_dir)
    assert out.returncode == 0 and "status KILLED" in out.stdout, out.stderr
    client = MlflowClient(up.uri)
    run = _run(client, "killed")
    assert run.info.status == "KILLED" and "without closing" in run.data.tags[ENDED_BY_TAG]
    assert _steps(client, run.info.run_id, "loss") == list(range(1, 21))
    assert [f.path for f in client.list_artifacts(run.info.run_id, "notes")] == ["notes/last.txt"]


def test_logged_model_loads_back_and_registers(up, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", up.uri)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    tracker = RunTracker("model", experiment="spool-test", tracking_uri=up.uri,
                         spool_dir=str(tmp_path / "run" / "mlflow"))
    tracker.log_metrics({"loss": 0.1}, 7)
    tracker.log_model(net, "net")
    assert tracker.close().unsent == 0
    client = MlflowClient(up.uri)
    (output,) = client.get_run(tracker.run_id).outputs.model_outputs
    assert output.step == 7
    loaded = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    x = torch.randn(5, 4)
    assert torch.equal(loaded(x), net(x))
    version = mlflow.register_model(f"models:/{output.model_id}", "spool-test-net")
    assert output.model_id in client.get_model_version("spool-test-net", version.version).source
    registered = mlflow.pytorch.load_model(f"models:/spool-test-net/{version.version}")
    assert torch.equal(registered(x), net(x))


STREAM = textwrap.dedent("""
    import sys
    from hybrid_ray.tracking import RunTracker
    uri, spool, name = sys.argv[1], sys.argv[2], sys.argv[3]
    t = RunTracker(name, experiment="spool-test", tracking_uri=uri, spool_dir=spool)
    for step in range(1, 100001):
        t.log_metrics({"loss": 1.0 / step, "lr": 0.5}, step)
        if step % 25 == 0:
            t.log_text(f"step {step}", f"notes/at{step}.txt")
        print(step, flush=True)  # after log_metrics returned: the step is the tracker's
""")


@pytest.mark.parametrize("seed", range(8))
def test_a_driver_killed_at_a_random_moment_loses_no_step_and_duplicates_none(up, tmp_path, seed):
    """SIGKILL while the sender is busy (a batch in flight, an artifact uploading, the ack file
    being replaced), at a seeded random moment: sync then completes the run with every step the
    tracker took exactly once, and the run ends KILLED."""
    import random
    name, run_dir = f"stream-{seed}", tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", STREAM, up.uri, str(run_dir / "mlflow"), name],
                             stdout=subprocess.PIPE, text=True, env=env)
    target = random.Random(seed).randint(30, 400)
    taken = 0
    for line in child.stdout:
        taken = int(line)
        if taken >= target:
            break
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    taken = max([taken] + [int(x) for x in child.stdout.read().split()])  # printed before the kill
    out = _sync_cli(run_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    client = MlflowClient(up.uri)
    run = _run(client, name)
    assert run.info.status == "KILLED"
    history = client.get_metric_history(run.info.run_id, "loss")
    steps = sorted(m.step for m in history)
    assert steps[:taken] == list(range(1, taken + 1)), (taken, steps[:10])  # none lost
    assert len(steps) == len(set(steps)), "a step twice"  # none duplicated
    notes = {f.path for f in client.list_artifacts(run.info.run_id, "notes")}
    assert {f"notes/at{s}.txt" for s in range(25, taken + 1, 25)} <= notes
