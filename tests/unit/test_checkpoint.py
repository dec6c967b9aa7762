"""Checkpoint save/load in one process: round trip, client_state, atomicity, corruption."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid_ray.engine.zero import relayout
from hybrid_ray.engine import CheckpointError
from hybrid_ray.engine import Engine

CFG = {"train_micro_batch_size_per_gpu": 4,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"}}}


def make(seed: int = 0, cfg: dict | None = None) -> Engine:
    torch.manual_seed(seed)
    return Engine(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), cfg or CFG)


def train(engine: Engine, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def state(engine: Engine) -> dict:
    s = relayout.export_state(engine.spaces, engine.zero.masters, engine.optimizer, engine.topology)
    return {n: s[id(p)] for n, p in engine.module.named_parameters()}


def assert_equal_state(a: Engine, b: Engine) -> None:
    sa, sb = state(a), state(b)
    for n in sa:
        assert sa[n].keys() == sb[n].keys()
        assert all(torch.equal(sa[n][k], sb[n][k]) for k in sa[n]), n
    assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))


def test_round_trip_resumes_bitwise(tmp_path: Path) -> None:
    engine = make()
    train(engine, range(3))
    path = engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "seen": [1, 2], "x": None})
    assert path.endswith("global_step3") and (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "latest"]  # staging moved
    loaded = make(seed=1)
    got_path, client = loaded.load_checkpoint(str(tmp_path))
    assert got_path == path and client == {"epoch": 3, "seen": [1, 2], "x": None}
    assert (loaded.global_steps, loaded.micro_steps, loaded.global_samples) == (3, 3, 12)
    assert loaded.get_lr() == engine.get_lr() and loaded.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    assert_equal_state(engine, loaded)
    train(engine, range(3, 6))
    train(loaded, range(3, 6))
    assert_equal_state(engine, loaded)


def test_module_only_and_uri(tmp_path: Path) -> None:
    engine = make()
    train(engine, range(2))
    engine.save_checkpoint(f"file://{tmp_path}/ckpts", tag="mine")  # through FileSystem.from_uri
    loaded = make(seed=1)
    path, _ = loaded.load_checkpoint(tmp_path / "ckpts", tag="mine", load_module_only=True)
    assert path.endswith("mine") and loaded.global_steps == 0 and not loaded.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), loaded.module.parameters()))


def test_client_state_must_load_back_with_weights_only(tmp_path: Path) -> None:
    # Tensors and tuples are kept (client_state.pt, tests/unit/test_compat_checkpoint.py); what
    # torch.load(weights_only=True) would refuse is refused at save time, by its key.
    engine = make()
    with pytest.raises(CheckpointError, match=r"client_state\['t'\]\[0\]: a builtins.function"):
        engine.save_checkpoint(tmp_path, client_state={"t": [lambda: 0]})
    with pytest.raises(CheckpointError, match="must be a dict"):
        engine.save_checkpoint(tmp_path, client_state=[1])


def test_nothing_to_load(tmp_path: Path) -> None:
    engine = make()
    assert engine.load_checkpoint(tmp_path / "absent") == (None, None)
    assert engine.load_checkpoint(tmp_path) == (None, None)
    assert engine.load_checkpoint(tmp_path, tag="nope") == (None, None)
    (tmp_path / "global_step9.tmp-abcd").mkdir()  # a save killed before its manifest: ignored
    assert engine.load_checkpoint(tmp_path) == (None, None)


def test_corrupt_latest_falls_back_named_tag_fails(tmp_path: Path, caplog) -> None:
    engine = make()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path)
    want = state(engine)
    train(engine, range(1, 2))
    engine.save_checkpoint(tmp_path)
    params = next((tmp_path / "global_step2").glob("params-rank*"))
    params.write_bytes(params.read_bytes()[:-10])  # truncated
    loaded = make(seed=1)
    with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
        path, _ = loaded.load_checkpoint(tmp_path)
    assert path.endswith("global_step1") and loaded.global_steps == 1
    assert "global_step2 is corrupt" in caplog.text and "instead of global_step2" in caplog.text
    got = state(loaded)
    assert all(torch.equal(got[n][k], want[n][k]) for n in want for k in want[n])
    # truncated: the sizes tell, before a byte is read
    with pytest.raises(CheckpointError, match=r"global_step2 is corrupt: params-rank00000\S* has \d+ bytes, "
                                              r"the manifest says \d+"):
        loaded.load_checkpoint(tmp_path, tag="global_step2")
    (tmp_path / "global_step1" / "manifest.json").unlink()  # nothing good left
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        loaded.load_checkpoint(tmp_path)


def test_fp16_loss_scaler_state_round_trip(tmp_path: Path) -> None:
    cfg = {**CFG, "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}
    torch.manual_seed(0)
    engine = Engine(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), cfg)
    train(engine, range(3))
    engine.save_checkpoint(tmp_path)
    torch.manual_seed(1)
    loaded = Engine(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), cfg)
    loaded.load_checkpoint(tmp_path)
    assert loaded.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
    assert loaded.loss_scale == engine.loss_scale != 2.0 ** 8  # the window moved the scale
    assert_equal_state(engine, loaded)


def test_other_model_is_a_clear_error(tmp_path: Path) -> None:
    make().save_checkpoint(tmp_path)
    torch.manual_seed(0)
    other = Engine(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), CFG)
    with pytest.raises(CheckpointError, match=r"parameter '\d.weight': checkpoint shape \(\d+, \d+\), model"):
        other.load_checkpoint(tmp_path)


def test_copy_fallback_writes_manifest_last(tmp_path: Path) -> None:
    from hybrid_ray.engine.checkpoint import storage as cio
    engine = make()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path / "a")
    fs, root = cio.filesystem(tmp_path)
    cio.copy_dir_manifest_last(fs, f"{root}/a/global_step1", f"{root}/b/global_step1")
    assert not (tmp_path / "a" / "global_step1").exists()
    path, _ = make(seed=1).load_checkpoint(tmp_path / "b")  # no `latest` there: found by its manifest
    assert path.endswith("global_step1")
