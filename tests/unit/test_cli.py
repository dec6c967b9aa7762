"""`hybrid-ray config check`: ok line with the resolved settings, or one error line and exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_ray.cli import main

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, raw: object, name: str = "cfg.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def check(path: str, capsys: pytest.CaptureFixture, *flags: str) -> tuple:
    code = main(["config", "check", path, *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_engine_config_ok_prints_precision_and_stage(tmp_path, capsys):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                            "zero_optimization": {"stage": 2}})
    code, out, err = check(path, capsys)
    assert code == 0 and err == ""
    assert out.startswith("ok: ") and "precision bf16" in out and "ZeRO stage 2" in out


def test_shipped_job_file_is_valid(capsys):
    code, out, _ = check(str(REPO / "jobs" / "configs" / "small_cpu.json"), capsys)
    assert code == 0 and out.startswith("ok: job file;")


def test_unknown_key_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = check(write(tmp_path, {"optimiser": {"type": "AdamW"}}), capsys)
    assert code == 2 and out == ""
    assert err == "error: optimiser: unknown key; did you mean 'optimizer'?\n"


def test_not_supported_feature_is_refused(tmp_path, capsys):
    code, _, err = check(write(tmp_path, {"zero_optimization": {"offload_param": {"device": "cpu"}}}), capsys)
    assert code == 2
    assert err.startswith("error: zero_optimization.offload_param.device: not supported yet; got 'cpu'")


def test_model_parallel_sizes_split_the_world(tmp_path, capsys):
    path = write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                            "tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2})
    code, out, _ = check(path, capsys, "--world-size", "16")
    assert code == 0 and out.endswith("world size 16: batch 16 = micro-batch 8 x 1 accumulation steps "
                                      "x 2 data-parallel ranks (tensor 4 x pipeline 2 ranks per replica)\n")
    code, _, err = check(path, capsys, "--world-size", "12")
    assert code == 2 and err.startswith("error: tensor_model_parallel_size: does not fit the world size")


def test_bad_key_inside_job_file_names_its_section(tmp_path, capsys):
    job = {"engine": {"fp16": {"enabeld": True}}, "train": {"steps": 5}}
    code, _, err = check(write(tmp_path, job), capsys)
    assert code == 2
    assert err == "error: [engine] fp16.enabeld: unknown key; did you mean 'enabled'?\n"
    job = {"engine": {"train_batch_size": 8}, "model": {"layers": 2}, "train": {"steps": 5}}
    code, _, err = check(write(tmp_path, job), capsys)
    assert code == 2 and err.startswith("error: model.layers: unknown key")


def test_missing_file_and_bad_json(tmp_path, capsys):
    code, _, err = check(str(tmp_path / "absent.json"), capsys)
    assert code == 2 and "config file not found" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{\"fp16\": ")
    code, _, err = check(str(bad), capsys)
    assert code == 2 and "invalid JSON at line 1" in err and err.count("\n") == 1


def test_console_script_entry_point(tmp_path):
    """The same through a real process: what a user's shell sees (exit status, stderr)."""
    path = write(tmp_path, {"zero_optimization": {"offload_param": {"device": "cpu"}}})
    proc = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "config", "check", path],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: zero_optimization.offload_param.device: not supported yet")


def test_train_rejects_a_bad_job_file_before_starting_processes(tmp_path, capsys):
    job = {"engine": {"train_micro_batch_size_per_gpu": 2,
                      "scheduler": {"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 50, "warmup_num_steps": 5}}},
           "train": {"steps": 10}}
    assert main(["train", write(tmp_path, job), "--nproc", "2"]) == 2
    assert "contradiction; got 50, 10" in capsys.readouterr().err
