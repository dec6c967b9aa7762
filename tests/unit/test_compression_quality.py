"""jobs/compression_quality.py on a tiny job: top-k at ratio 1.0 trains exactly as dense (the
engine's compressor sends everything), ratio 0.01 sends ~50x fewer bytes after its warm-up,
and a malformed variant is a one-line error."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from tests.jobs_scripts import load_script
from tests.unit.test_lm_job import TINY


def load_study():
    return load_script("compression_quality")


@pytest.fixture(scope="module")
def job_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("quality")
    job = copy.deepcopy(TINY)
    job["data"]["path"] = str(root / "stdlib-bytes")
    job["engine"]["gradient_clipping"] = 1.0
    path = root / "job.json"
    path.write_text(json.dumps(job))
    return path


def test_ratio_one_is_dense_and_small_ratio_sends_fewer_bytes(job_file, tmp_path, capsys):
    rows = load_study().main(["--config", str(job_file), "--steps", "4", "--device", "cpu", "--seeds", "2",
                              "--variant", "topk:1.0:0", "--variant", "topk:0.01:2",
                              "--out", str(tmp_path / "q.jsonl")])
    res = {r["variant"]: r for r in rows}
    assert list(res) == ["dense", "topk:1.0:0", "topk:0.01:2"]  # dense is added as the baseline
    assert res["topk:1.0:0"]["val_loss"] == res["dense"]["val_loss"]  # every seed, exactly
    assert len(res["dense"]["val_loss"]) == 2 and res["dense"]["seeds"][1] == res["dense"]["seeds"][0] + 1
    assert res["topk:0.01:2"]["val_loss"] != res["dense"]["val_loss"]
    assert 45 < res["topk:0.01:2"]["bytes_ratio_after_warmup"] <= 50
    assert res["topk:0.01:2"]["bytes_ratio_whole_run"] < 5  # the two dense-ish warm-up steps count
    assert not res["topk:0.01:2"]["meets_bar"]  # 5x over the whole run is short of 10x
    corpus = res["dense"]["corpus"]
    assert len(corpus["sha256"]) == 64 and corpus["train_tokens"] > 0 and res["dense"]["passes"] == 1
    written = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in written] == list(res)
    table = capsys.readouterr().out
    assert "| topk:0.01:2 |" in table and "| dense | " in table


def test_no_window_is_seen_twice_unless_allowed():
    study = load_study()
    w = study.Windows(10, seed=1, allow_repeat=False, need=10)
    seen = torch.cat([w.take(5), w.take(5)])
    assert sorted(seen.tolist()) == list(range(10)) and w.passes == 1
    with pytest.raises(SystemExit, match="needs 12 training windows, the corpus has 10"):
        study.Windows(10, seed=1, allow_repeat=False, need=12)
    w = study.Windows(10, seed=1, allow_repeat=True, need=12)
    w.take(8)
    w.take(4)  # the first pass has 2 left: a new permutation
    assert w.passes == 2


@pytest.mark.parametrize("bad", ["topk", "topk:0:10", "topk:0.01", "powersgd:4:0", "topk:x:1",
                                 "topk:0.1:0:int4", "topk:0.1:0:int8:int16",
                                 "onebit", "onebit:0", "onebit:x", "onebit:5:1", "onebit:5:x", "frozen:0",
                                 "onebit:5:b16", "onebit:5:r0", "onebit:5:b64:b128", "onebit:5:q3", "onebit:5:256"])
def test_bad_variant_is_one_line(bad):
    with pytest.raises(SystemExit, match=r"^--variant .*expected 'dense', 'topk:RATIO:WARMUP"):
        load_study().parse_variant(bad)


def test_a_cheaper_payload_is_counted_in_its_own_bytes(job_file, tmp_path):
    rows = load_study().main(["--config", str(job_file), "--steps", "3", "--device", "cpu", "--seeds", "1",
                              "--variant", "topk:0.01:0", "--variant", "topk:0.01:0:int8:block16",
                              "--out", str(tmp_path / "q.jsonl")])
    res = {r["variant"]: r for r in rows}
    ratio = res["topk:0.01:0:int8:block16"]["bytes_ratio_whole_run"] / res["topk:0.01:0"]["bytes_ratio_whole_run"]
    assert 2.3 < ratio < 2.8  # 3 bytes per kept element and a few block counts, against 8


def test_runs_in_worker_processes_match_runs_in_one(job_file, tmp_path, monkeypatch):
    from tests.jobs_scripts import JOBS
    monkeypatch.syspath_prepend(str(JOBS))  # spawned workers import the study by its module name
    argv = ["--config", str(job_file), "--steps", "3", "--device", "cpu", "--seeds", "2",
            "--variant", "topk:0.05:1", "--out", str(tmp_path / "q.jsonl")]
    serial = {r["variant"]: r for r in load_study().main(argv)}
    pooled = {r["variant"]: r for r in load_study().main(argv + ["--workers", "2"])}
    assert list(pooled) == ["dense", "topk:0.05:1"]
    for name, row in serial.items():  # the same runs, in the same (variant, seed) order
        assert pooled[name]["val_loss"] == pytest.approx(row["val_loss"], rel=1e-5)
        assert pooled[name]["bytes_ratio_whole_run"] == row["bytes_ratio_whole_run"]


def test_onebit_adam_equals_dense_during_its_warm_up_then_sends_one_bit(job_file, tmp_path):
    rows = load_study().main(["--config", str(job_file), "--steps", "3", "--device", "cpu", "--seeds", "1",
                              "--variant", "onebit:3", "--variant", "onebit:1", "--variant", "onebit-grad:1", "--out", str(tmp_path / "q.jsonl")])
    res = {r["variant"]: r for r in rows}
    assert res["onebit:3"]["val_loss"] == res["dense"]["val_loss"]  # all warm-up: plain AdamW
    assert res["onebit:3"]["bytes_ratio_after_warmup"] is None
    assert res["onebit:1"]["val_loss"] != res["dense"]["val_loss"]
    assert 28 < res["onebit:1"]["bytes_ratio_after_warmup"] <= 32
    assert res["onebit-grad:1"]["val_loss"] not in (res["dense"]["val_loss"], res["onebit:1"]["val_loss"])
    assert 28 < res["onebit-grad:1"]["bytes_ratio_after_warmup"] <= 32


def test_the_freeze_alone_finer_scales_and_preconditioning_are_variants_too(job_file, tmp_path):
    """frozen:W: the variance frozen after W steps with exact gradients (dense bytes); onebit:W:B:
    a scale per B elements, counted in the bytes (1/8 + 4/B bytes per element)."""
    rows = load_study().main(["--config", str(job_file), "--steps", "3", "--device", "cpu", "--seeds", "1",
                              "--variant", "frozen:1", "--variant", "onebit:1", "--variant", "onebit:1:b64",
                              "--variant", "onebit-pre:1", "--out", str(tmp_path / "q.jsonl")])
    res = {r["variant"]: r for r in rows}
    assert res["frozen:1"]["bytes_ratio_after_warmup"] == 1.0
    assert 28 < res["onebit-pre:1"]["bytes_ratio_after_warmup"] <= 32
    names = ("dense", "frozen:1", "onebit:1", "onebit:1:b64", "onebit-pre:1")
    assert len({res[v]["val_loss"][0] for v in names}) == len(names)
    assert all(math.isfinite(res[v]["val_loss"][0]) for v in names)
    assert 20 < res["onebit:1:b64"]["bytes_ratio_after_warmup"] < 21.4


def test_a_variance_refresh_is_a_dense_adamw_step_between_frozen_ones(job_file, tmp_path):
    """frozen:1:r1 refreshes at every step after the first frozen one: from then on plain AdamW
    with exact gradients; the refresh steps are counted as dense bytes."""
    rows = load_study().main(["--config", str(job_file), "--steps", "5", "--device", "cpu", "--seeds", "1",
                              "--variant", "frozen:1", "--variant", "frozen:1:r1", "--variant", "onebit:1:r2",
                              "--out", str(tmp_path / "q.jsonl")])
    res = {r["variant"]: r for r in rows}
    assert len({res[v]["val_loss"][0] for v in ("dense", "frozen:1", "frozen:1:r1")}) == 3
    after = 4 / (1 + 3 / 32)  # steps 1-4 after the warm-up: step 3 a refresh at fp32, 3 at one bit
    assert res["onebit:1:r2"]["bytes_ratio_after_warmup"] == pytest.approx(after, rel=0.03)


def test_the_published_update_and_the_first_seed_are_options(job_file, tmp_path):
    """':c0' drops the engine's update_bound (1-bit Adam as published): same bytes, another
    loss; --seed moves the seeds the rows name and the runs they make."""
    study = load_study()
    args = ["--config", str(job_file), "--steps", "4", "--device", "cpu", "--seeds", "1", "--out", str(tmp_path / "q.jsonl")]
    rows = study.main(args + ["--variant", "frozen:1", "--variant", "frozen:1:c0"])
    res = {r["variant"]: r for r in rows}
    assert res["frozen:1"]["val_loss"] != res["frozen:1:c0"]["val_loss"]
    assert study.parse_variant("onebit:200:c0").bound is False and study.parse_variant("onebit:200").bound
    moved = study.main(args + ["--seed", "77"])
    assert moved[0]["seeds"] == [77] and moved[0]["val_loss"] != rows[0]["val_loss"]
