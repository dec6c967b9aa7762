"""The driver's compression directives on a real local Ray: sent at arbitrary moments, applied
by every rank at the same step (the ranks agree through a collective), parameters equal on all
ranks afterwards; and the LM job with `gradient_compression.type: auto` records its decisions."""
from __future__ import annotations

import json
import threading
import time

import pytest

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
from tests.cluster import trainfns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
SLOT = {"CPU": 1, "slot": 1}


def test_directives_apply_at_the_same_step_on_every_rank(ray_session, tmp_path):
    records = []
    trainer = ElasticTrainer(lambda ctx: trainfns.train_following(ctx, steps=24, step_delay=0.15),
                             ScalingConfig(min_workers=2, max_workers=2, resources_per_worker=SLOT),
                             FailureConfig(max_failures=0, collective_timeout_s=20.0),
                             storage_path=str(tmp_path), run_name="follow", on_record=records.append)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    t.start()
    settings = [{"type": "topk", "topk_ratio": 0.1}, {"type": "bf16"}, {"type": "none"}]
    deadline = time.monotonic() + 200
    for i, (at_step, setting) in enumerate(zip((3, 9, 15), settings), start=1):
        while trainer.controller is None or trainer.controller._last_step < at_step:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.05)
        trainer.controller.send_directive({"id": i, "setting": setting, "reason": "test"})
    t.join(200)
    assert "result" in box
    final = {r["rank"]: r for r in records if "applied" in r}
    assert set(final) == {0, 1}
    applied = [[tuple(a) for a in final[r]["applied"]] for r in (0, 1)]
    assert applied[0] == applied[1], applied  # same steps, same ids, on both ranks
    assert [a[1:] for a in applied[0]] == [(1, "topk"), (2, "bf16"), (3, "none")]
    assert final[0]["checksum"] == final[1]["checksum"]  # the ranks never diverged


def test_lm_job_auto_compression_records_its_decisions(ray_session, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from hybrid_ray.lm.elastic import run_elastic
    from tests.cluster.test_lm_on_ray import job

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    data = tmp_path / "data"
    raw = job(data, tmp_path / "lm-auto", steps=40)
    raw["engine"]["steps_per_print"] = 4
    raw["engine"]["gradient_compression"] = {"type": "auto", "topk_ratio": 0.01, "rank": 2}
    raw["data"]["prepare"] = True
    assert run_elastic(raw, 2, 2) == 0
    out = capsys.readouterr().out
    assert "compression: a group of 2 formed; link " in out and " MB/s" in out
    decisions = [line for line in out.splitlines() if "event: compression: " in line and "formed" not in line]
    assert decisions, out[-3000:]  # dense measured first, then kept or compression tried
    assert any(w in decisions[0] for w in ("keeping dense", "trying ")), decisions
    records = [json.loads(x) for x in (tmp_path / "lm-auto" / "metrics.jsonl").read_text().splitlines()]
    ids = [r["compression_id"] for r in records if "compression_id" in r]
    assert ids[0] == 0 and ids == sorted(ids)  # rank 0 reports the setting in force, in order
    if "trying " in decisions[0]:  # the ranks switched (at one step: a collective agreed on it)
        assert ids[-1] >= 1

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("hybrid_ray").experiment_id],
                               "tags.`hybrid_ray.run_name` = 'lm-auto'")
    assert run.data.tags["compression.setting"] in ("dense", "bf16", "topk 0.01", "powersgd rank 2", "onebit momentum")
    assert client.get_metric_history(run.info.run_id, "comm/interval_comm_s")
