"""The MLflow spool without a server: the journal's round trip, a torn last line, acknowledgement
bookkeeping, and `sync` when nothing is pending, the writer is alive or the server is away."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from hybrid_ray.tracking import ops
from hybrid_ray.tracking.journal import ACK, JOURNAL, LOCK, Journal, sync_command
from hybrid_ray.tracking.sync import sync

ITEMS = [ops.Params({"lr": "0.1"}), ops.Metrics([("loss", 1.5, 1, 1000), ("acc", float("nan"), 1, 1000)]),
         ops.SystemMetrics({"system/cpu": 3.0}, 0, 1001), ops.Tags({"a": "b"}),
         ops.Event("worker 1 lost", "failure", "line", {"recovery_s": 2.0}, 1, 1002),
         ops.Dataset("data", "abc", "local", "/data", profile='{"tokens": 3}'),
         ops.Terminate("FAILED", 1003)]


def _started(spool) -> Journal:
    j = Journal.read(str(spool))
    j.start("http://127.0.0.1:1", "exp", "run-a")
    return j


def _same(a, b) -> bool:  # NaN != NaN: compare the JSON
    return json.dumps(ops.to_record(a)) == json.dumps(ops.to_record(b))


def test_round_trip_every_kind(tmp_path):
    spool = tmp_path / "mlflow"
    j = _started(spool)
    staged = spool / "staged" / "item-1"
    staged.mkdir()
    (staged / "notes.txt").write_text("hi")
    items = ITEMS[:-1] + [ops.Artifact(str(staged / "notes.txt"), "notes", staged=True),
                          ops.Model(str(staged), "model", step=3), ITEMS[-1]]
    for item in items:
        j.append(item)
    j.close()
    lines = (spool / JOURNAL).read_text().splitlines()
    assert json.loads(lines[0]) == {"format": "hybrid_ray-mlflow-journal", "version": 1,
                                    "tracking_uri": "http://127.0.0.1:1", "experiment": "exp",
                                    "run_name": "run-a"}
    assert json.loads(lines[7])["local_path"] == "staged/item-1/notes.txt"  # relative: the folder may move
    back = Journal.read(str(spool))
    assert [i.seq for i in back.items] == list(range(1, len(items) + 1))
    assert all(_same(a, b) for a, b in zip(items, back.items))
    assert back.items[6].local_path == str(staged / "notes.txt")


def test_torn_last_line_is_ignored_and_dropped_on_restart(tmp_path):
    spool = tmp_path / "mlflow"
    j = _started(spool)
    for item in ITEMS[:3]:
        j.append(item)
    j.close()
    with open(spool / JOURNAL, "a") as f:
        f.write('{"seq": 4, "op": "metrics", "items": [["lo')  # killed mid-write
    back = Journal.read(str(spool))
    assert [i.seq for i in back.items] == [1, 2, 3]
    back.start("http://127.0.0.1:1", "exp", "run-a")
    back.append(ops.Tags({"x": "y"}))
    back.close()
    again = Journal.read(str(spool))
    assert [(i.seq, type(i).__name__) for i in again.items] == [(1, "Params"), (2, "Metrics"),
                                                               (3, "SystemMetrics"), (4, "Tags")]


def test_acknowledged_items_are_not_pending_and_restart_compacts(tmp_path):
    spool = tmp_path / "mlflow"
    j = _started(spool)
    for item in ITEMS:
        j.append(item)
    j.record_model(6, "m-123")
    j.ack(3, run_id="r1")
    back = Journal.read(str(spool))
    assert [i.seq for i in back.items] == [4, 5, 6, 7] and back.run_id == "r1" and back.ended is None
    assert back.models == {"6": "m-123"}
    j.ack(7, ended="FAILED")
    j.close()
    done = Journal.read(str(spool))
    assert done.items == [] and done.ended == "FAILED" and done.models == {}
    # The next session: acknowledged lines are gone, numbering goes on.
    done.start("http://127.0.0.1:1", "exp", "run-a")
    done.append(ops.Tags({"x": "y"}))
    done.close()
    assert len((spool / JOURNAL).read_text().splitlines()) == 2
    assert Journal.read(str(spool)).items[0].seq == 8
    assert json.loads((spool / ACK).read_text())["ended"] is None  # open again


def test_a_resumed_session_supersedes_the_old_terminate(tmp_path):
    spool = tmp_path / "mlflow"
    j = _started(spool)
    for item in ITEMS:
        j.append(item)
    j.close()
    pending = Journal.read(str(spool)).start("http://127.0.0.1:1", "exp", "run-a")
    assert [type(i).__name__ for i in pending][-1] == "Dataset"
    assert "terminate" not in (spool / JOURNAL).read_text()


def test_sync_with_nothing_pending_sends_nothing(tmp_path, capsys):
    spool = tmp_path / "run" / "mlflow"
    j = _started(spool)
    j.append(ops.Terminate("FINISHED", 1))
    j.ack(1, ended="FINISHED", run_id="r1")
    j.close()
    result = sync(str(tmp_path / "run"))  # the journal's server does not exist: never contacted
    assert result.code == 0 and result.line.startswith("nothing to send") and "FINISHED" in result.line
    assert sync_command(str(spool)) == f"hybrid-ray mlflow sync {tmp_path / 'run'}"


def test_sync_refuses_a_live_writer_and_an_unreachable_server(tmp_path):
    spool = tmp_path / "run" / "mlflow"
    j = _started(spool)
    j.append(ITEMS[1])
    j.close()
    before = (spool / JOURNAL).read_text(), (spool / ACK).read_text()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = sync(str(tmp_path / "run"), tracking_uri=f"http://127.0.0.1:{port}")
    assert result.code == 1 and "cannot be reached" in result.line and "1 item(s) stay" in result.line
    assert ((spool / JOURNAL).read_text(), (spool / ACK).read_text()) == before  # nothing lost
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (spool / LOCK).write_text(json.dumps({"pid": writer.pid, "host": socket.gethostname()}))
        result = sync(str(tmp_path / "run"))
        assert result.code == 1 and f"pid {writer.pid}" in result.line
    finally:
        writer.kill()
        writer.wait()


def test_cli_says_when_there_is_no_spool(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "mlflow", "sync", str(tmp_path)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1 and out.stderr.strip() == f"error: no MLflow spool in {tmp_path} (no mlflow/journal.jsonl)"
