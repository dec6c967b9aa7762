"""Checkpoints load at any world size and ZeRO stage, and resume training bitwise (fp32, gloo)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import torch

from hybrid_ray.engine.zero import relayout
from hybrid_ray.engine.checkpoint.storage import TENSOR_EXT
from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT
from tests.distributed import spawn
from tests.distributed.test_zero_parity import CFG, S3, batch, config

pytestmark = [pytest.mark.dist, pytest.mark.slow]
SAVED_AT, TOTAL = 3, 5


def make(stage: int, seed: int = 0, extra: dict | None = None) -> Engine:
    torch.manual_seed(seed)
    return Engine(GPT(CFG), config(stage, 1, 0.0, extra or {}), topology=Topology.from_environment())


def train(engine: Engine, rank: int, world: int, steps: range) -> None:
    for step in steps:
        engine.backward(engine(*batch(step, 0, rank, world)))
        engine.step()


def exported(engine: Engine) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every parameter's fp32 master and Adam moments by name, plus Adam's step (collective)."""
    state = relayout.export_state(engine.spaces, engine.zero.masters, engine.optimizer, engine.topology)
    out = {n: {k: t.cpu() for k, t in state[id(p)].items()} for n, p in engine.module.named_parameters()}
    # clone: on the CPU .cpu() is the optimizer's own step tensor, which later steps increment
    out["<step>"] = {"step": relayout.scalar_state(engine.optimizer, engine.zero.masters)["step"].cpu().clone()}
    return out


def assert_same(got: Dict[str, Dict[str, torch.Tensor]], want: Dict[str, Dict[str, torch.Tensor]], what: str):
    assert got.keys() == want.keys(), what
    for name in want:
        assert got[name].keys() == want[name].keys(), (what, name)
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), f"{what}: {name}/{key} differs"


def check_load(engine: Engine, root: str, out: str, what: str) -> None:
    path, client = engine.load_checkpoint(root)
    assert path is not None and path.endswith(f"global_step{SAVED_AT}"), path
    assert client == {"epoch": 2, "note": "s2 run"}
    assert engine.global_steps == SAVED_AT and engine.micro_steps == SAVED_AT
    assert_same(exported(engine), torch.load(Path(out) / "saved.pt"), what)
    masters = engine.consolidated_state_dict(rank0_only=False)
    want = torch.load(Path(out) / "saved.pt")
    assert all(torch.equal(masters[n], want[n]["master"]) for n, _ in engine.module.named_parameters()), what


def two_ranks(rank: int, world: int, out: str) -> None:
    a, b = str(Path(out) / "a"), str(Path(out) / "b")
    # (1) the checkpoint that other world sizes and stages load: stage 2 after 3 steps.
    engine = make(2)
    train(engine, rank, world, range(SAVED_AT))
    engine.save_checkpoint(a, client_state={"epoch": 2, "note": "s2 run"})
    saved = exported(engine)
    if rank == 0:
        torch.save(saved, Path(out) / "saved.pt")
    engine.close()
    # (2) stage 1: an uninterrupted run vs the same run resumed from its step-3 checkpoint.
    engine = make(1)
    train(engine, rank, world, range(SAVED_AT))
    engine.save_checkpoint(b)
    train(engine, rank, world, range(SAVED_AT, TOTAL))
    want = exported(engine)
    engine.close()
    resumed = make(1, seed=123)  # other initial weights: everything must come from the checkpoint
    path, client = resumed.load_checkpoint(b)
    assert path.endswith(f"global_step{SAVED_AT}") and client == {}
    train(resumed, rank, world, range(SAVED_AT, TOTAL))
    assert resumed.global_steps == TOTAL
    assert_same(exported(resumed), want, "resumed stage 1")
    resumed.close()
    # (1) loaded by 2 ranks at stage 3 with partitioned parameters.
    engine = make(3, seed=7, extra={"stage3_param_persistence_threshold": S3["stage3_param_persistence_threshold"]})
    check_load(engine, a, out, "2 ranks stage 3")
    engine.save_checkpoint(str(Path(out) / "c"), client_state={"epoch": 2, "note": "s2 run"})  # saved at stage 3
    engine.close()


def load_elsewhere(rank: int, world: int, out: str, stage: int) -> None:
    engine = make(stage, seed=5)
    check_load(engine, str(Path(out) / "a"), out, f"{world} rank(s) stage {stage}")
    engine.close()
    if world == 1:  # the copy written by 2 ranks at stage 3 holds the same state
        check_load(make(stage, seed=6), str(Path(out) / "c"), out, "saved at stage 3")


def test_checkpoint_any_world_size_and_resume(tmp_path: Path) -> None:
    spawn.run(two_ranks, 2, str(tmp_path), timeout_s=120)
    files = sorted(p.name for p in (tmp_path / "a" / f"global_step{SAVED_AT}").iterdir())
    ext = TENSOR_EXT  # .pt, or .safetensors when installed
    assert files == ["manifest.json", "meta.json", f"params-rank00000-00000{ext}",
                     f"params-rank00001-00000{ext}", "rng-rank00000.json", "rng-rank00001.json"], files
    # each rank wrote its share (in one part: far below 1 GiB); no markers or staging left over
    spawn.run(load_elsewhere, 1, str(tmp_path), 0, timeout_s=120)
    spawn.run(load_elsewhere, 3, str(tmp_path), 1, timeout_s=120)
