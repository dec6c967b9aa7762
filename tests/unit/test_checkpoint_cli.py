"""`hybrid-ray checkpoint inspect|export` on a one-process checkpoint of a model with a buffer,
a frozen parameter and tied weights: the export is exactly `module.state_dict()`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid_ray.cli import main as cli
from hybrid_ray.engine import Engine

CFG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)  # running statistics: persistent buffers
        self.out = nn.Linear(16, 8)
        self.out_again = nn.Linear(16, 8, bias=False)
        self.out_again.weight = self.out.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(self.frozen(x)))
        return self.out(h) + self.out_again(h)


def trained(tmp_path: Path, steps: int = 3) -> Engine:
    torch.manual_seed(0)
    engine = Engine(Model(), CFG)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(F.mse_loss(engine(x), x))
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpts")
    return engine


def test_export_is_the_module_state_dict(tmp_path: Path, capsys) -> None:
    engine = trained(tmp_path)
    want = engine.module.state_dict()
    out = tmp_path / "model.safetensors"
    assert cli(["checkpoint", "export", str(tmp_path / "ckpts"), str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"exported {tmp_path}/ckpts/global_step3 -> {out}: {len(want)} tensors")
    got = safetensors.torch.load_file(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    plain = Model()
    plain.load_state_dict(got)  # strict
    assert cli(["checkpoint", "export", str(tmp_path / "ckpts"), str(tmp_path / "m.pt"),
                "--dtype", "bf16", "--tag", "global_step1"]) == 0
    old = torch.load(tmp_path / "m.pt", weights_only=True)
    assert old["out.weight"].dtype == torch.bfloat16 and old["frozen.weight"].dtype == torch.bfloat16
    assert old["norm.running_mean"].dtype == torch.float32  # buffers keep their dtype
    assert old["norm.num_batches_tracked"].item() == 1 and want["norm.num_batches_tracked"].item() == 3
    Model().load_state_dict(old)


def test_load_restores_buffers_and_frozen_parameters(tmp_path: Path) -> None:
    engine = trained(tmp_path)
    torch.manual_seed(5)
    loaded = Engine(Model(), CFG)
    loaded.load_checkpoint(tmp_path / "ckpts")
    want, got = engine.module.state_dict(), loaded.module.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_inspect_reports_files_and_checksums(tmp_path: Path, capsys) -> None:
    trained(tmp_path, steps=2)
    assert cli(["checkpoint", "inspect", str(tmp_path / "ckpts")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}/ckpts: 2 checkpoint(s), latest -> global_step2\n")
    assert "global_step2  [latest]: ok\n  step 2, saved by 1 rank(s) at ZeRO stage 0, precision fp32" in out
    assert out.count("  ok\n") == 8  # 4 files in each of the 2 checkpoints
    meta = tmp_path / "ckpts" / "global_step1" / "meta.json"
    meta.write_text(meta.read_text() + " ")  # one byte longer
    assert cli(["checkpoint", "inspect", str(tmp_path / "ckpts"), "--json"]) == 1
    reports = {r["tag"]: r for r in json.loads(capsys.readouterr().out)}
    assert reports["global_step2"]["ok"] and reports["global_step2"]["latest"]
    assert reports["global_step1"]["files"]["meta.json"]["status"].startswith("size mismatch (manifest: ")
    assert reports["global_step2"]["world_size"] == 1 and reports["global_step2"]["step"] == 2


@pytest.mark.parametrize("argv, code, message", [
    (["inspect", "{tmp}/absent"], 2, "error: {tmp}/absent: no such directory"),
    (["export", "{tmp}/ckpts", "{tmp}/model.bin"], 1,
     "error: {tmp}/model.bin: the output must end in .safetensors or .pt"),
    (["export", "{tmp}/ckpts", "{tmp}/m.pt", "--tag", "nope"], 1,
     "error: {tmp}/ckpts: no checkpoint 'nope' to export"),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys, argv: list, code: int, message: str) -> None:
    trained(tmp_path, steps=1)
    assert cli(["checkpoint"] + [a.format(tmp=tmp_path) for a in argv]) == code
    assert capsys.readouterr().err == message.format(tmp=tmp_path) + "\n"
