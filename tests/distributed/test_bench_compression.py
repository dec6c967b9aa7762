"""jobs/bench_compression.py end to end, tiny: a shaped netns link (root and iproute2 only) and
loopback; every setting is in the JSON, top-k sends far fewer bytes, the namespaces are gone.
Plus its one-line refusals, in process."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs_scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "jobs" / "bench_compression.py"
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--vocab", "64", "--seq", "16",
        "--micro-batch", "2", "--warmup", "1", "--steps", "2", "--rounds", "1", "--quiet"]
SETTINGS = {"dense", "bf16", "topk", "powersgd", "onebit"}
CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def run_bench(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, *flags, "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| setting | s/step (median) |" in proc.stdout and "| topk |" in proc.stdout
    return json.loads(out.read_text())


def check_settings(res: dict, wire: bool) -> None:
    s = res["settings"]
    assert set(s) == SETTINGS
    for name in ("dense", "bf16", "topk", "onebit"):
        assert s[name]["available"], s[name]
        assert len(s[name]["step_s"]) == 2 and s[name]["step_s_median"] > 0
        assert s[name]["speedup_vs_dense"] > 0
    # powersgd: measured where the engine has it, else the config's refusal as the reason.
    assert s["powersgd"]["available"] or s["powersgd"]["reason"]
    dense, topk = s["dense"]["bytes_sent_per_step"], s["topk"]["bytes_sent_per_step"]
    assert dense > 0 and topk * 20 < dense, (dense, topk)
    # ZeRO-2's "auto" form is the momentum form: one bit and a scale per slice to its owner,
    # then the owner's chunk back to all at one bit (1/8 + 1/16 of fp32 at two ranks)
    assert s["onebit"]["bytes_sent_per_step"] * 20 < dense
    assert s["bf16"]["bytes_sent_per_step"] * 2 == dense
    assert s["dense"]["speedup_vs_dense"] == 1.0
    if wire:  # the veth counters: ZeRO-2's parameter all-gather keeps top-k's traffic above half
        assert s["topk"]["wire_tx_bytes_per_step"] < 0.75 * s["dense"]["wire_tx_bytes_per_step"]
    else:
        assert s["dense"]["wire_tx_bytes_per_step"] is None


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(not CAN_NETNS, reason="needs root and iproute2 (ip, tc) for network namespaces")
def test_netns_shaped_link(tmp_path):
    res = run_bench(tmp_path, "--link", "netns", "--rate", "50mbit")
    check_settings(res, wire=True)
    link = res["link"]
    assert link["mode"] == "netns" and link["rate_bits_per_s"] == 50e6
    assert 0 < link["measured"]["bus_bits_per_s"] < 1.2 * 50e6  # the shaping holds
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in link["namespaces"]), left


@pytest.mark.dist
@pytest.mark.slow
def test_loopback(tmp_path):
    res = run_bench(tmp_path, "--link", "loopback", "--settings", "dense,bf16,topk,powersgd,onebit")
    check_settings(res, wire=False)
    assert res["link"]["mode"] == "loopback" and res["link"]["rate"] is None


def test_refusals(monkeypatch, capsys):
    bench = load_script("bench_compression")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    # ip and tc live in /usr/sbin, which a plain user's PATH may lack: only "not root" is tested
    monkeypatch.setattr(bench.shutil, "which", lambda name: f"/usr/sbin/{name}")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--link", "netns"])
    assert str(exc.value) == ("bench_compression: --link netns needs root and iproute2's ip and tc "
                              "(not root); try --link loopback")
    with pytest.raises(SystemExit, match="shape the netns link only"):
        bench.main(["--link", "loopback", "--rate", "10mbit"])
    with pytest.raises(SystemExit, match="expected a number with kbit"):
        bench.parse_rate("100")
    assert bench.parse_rate("1gbit") == 1e9 and bench.parse_rate("2.5Mbit") == 2.5e6
