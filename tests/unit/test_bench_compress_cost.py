"""jobs/bench_compress_cost.py on a tiny GPT on the CPU: both compressors run over every bucket
in a one-rank group, send fewer bytes than the dense reduction, and the break-even bandwidth is
the saved bytes over the measured time."""
from __future__ import annotations

import json

from tests.jobs_scripts import load_script


def test_tiny_model_on_cpu(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    out = load_script("bench_compress_cost").main(["--device", "cpu", "--model", "small",
                    "--bucket-numel", "200000", "--iters", "2", "--out", str(tmp_path / "c.json")])
    assert out["buckets"] > 1 and out["dense_bytes"] == 4 * out["params"]  # fp32 on the CPU
    methods = out["methods"]
    assert set(methods) == {"topk 0.01", "powersgd rank 4"}
    for r in methods.values():
        assert 0 < r["bytes_sent"] < out["dense_bytes"] / 5 and r["compress_s"] > 0
        assert abs(r["break_even_GBps"] * 1e9 * r["compress_s"] - (out["dense_bytes"] - r["bytes_sent"])) < 1
    # top-k: k = ceil(1% of each bucket) (index, value) pairs of 4 bytes each
    assert methods["topk 0.01"]["bytes_sent"] < 0.021 * out["dense_bytes"] + 8 * out["buckets"]
    assert json.loads((tmp_path / "c.json").read_text())["methods"].keys() == methods.keys()
    assert "| topk 0.01 |" in capsys.readouterr().out
