"""jobs/compression_quality.py on a tiny job: top-k at ratio 1.0 trains exactly as dense (the
engine's compressor sends everything), ratio 0.01 sends ~50x fewer bytes after its warm-up,
and a malformed variant is a one-line error."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

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
    out = load_study().main(["--config", str(job_file), "--steps", "4", "--device", "cpu",
                             "--variant", "topk:1.0:0", "--variant", "topk:0.01:2",
                             "--out", str(tmp_path / "q.json")])
    res = out["results"]
    assert list(res) == ["dense", "topk:1.0:0", "topk:0.01:2"]  # dense is added as the baseline
    assert res["topk:1.0:0"]["val_loss"] == res["dense"]["val_loss"]
    assert res["topk:0.01:2"]["val_loss"] != res["dense"]["val_loss"]
    assert 45 < res["topk:0.01:2"]["byte_ratio_after_warmup"] <= 50
    assert res["topk:0.01:2"]["byte_ratio_whole_run"] < 5  # the two dense-ish warm-up steps count
    assert json.loads((tmp_path / "q.json").read_text())["results"].keys() == res.keys()
    table = capsys.readouterr().out
    assert "| topk:0.01:2 |" in table and "| dense | " in table


@pytest.mark.parametrize("bad", ["topk", "topk:0:10", "topk:0.01", "powersgd:4:0", "topk:x:1"])
def test_bad_variant_is_one_line(bad):
    with pytest.raises(SystemExit, match=r"^--variant .*expected 'dense' or 'topk:RATIO:WARMUP'"):
        load_study().parse_variant(bad)
