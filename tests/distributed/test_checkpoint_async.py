"""Asynchronous saves on 2 gloo ranks (commit through files, errors on every rank), the data
position, and the offline export of ZeRO-2 and ZeRO-3 checkpoints into the plain GPT."""
from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from hybrid_ray.cli import main as cli
from hybrid_ray.engine.checkpoint import write as cwrite
from hybrid_ray.engine import CheckpointError
from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT
from tests.distributed import spawn
from tests.distributed.test_checkpoint import assert_same, exported, train
from tests.distributed.test_zero_parity import CFG, S3, config
from tests.unit.test_checkpoint_async import Loader

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def make(stage: int, seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    cfg = {**config(stage, 1, 0.0, S3 if stage == 3 else {}), "checkpoint": {"commit_timeout_s": 60}}
    engine = Engine(GPT(CFG), cfg, topology=Topology.from_environment())
    engine.training_dataloader = Loader()
    return engine


def fail_on_rank(rank: int, failing: int) -> None:
    """Make `failing`'s next tensor write raise, once."""
    real = cwrite.cio.write_tensors

    def write(fs, path, tensors, fsync=False):
        cwrite.cio.write_tensors = real
        raise OSError("disk full (test)")

    if rank == failing:
        cwrite.cio.write_tensors = write


def two_ranks(rank: int, world: int, out: str) -> None:
    root = Path(out)
    # (1) ZeRO-2, async: training goes on during the save; a rank-specific data position
    engine = make(2)
    engine.training_dataloader.sampler.position = 100 + rank  # rank 0's is the one saved
    train(engine, rank, world, range(2))
    saved = exported(engine)
    state_dict = engine.consolidated_state_dict()
    engine.save_checkpoint(str(root / "s2"), async_save=True)
    train(engine, rank, world, range(2, 4))
    assert engine.wait_checkpoint() == str(root / "s2" / "global_step2")
    if rank == 0:
        torch.save(state_dict, root / "s2.pt")
    # (2) a failed write on rank 1 reaches both ranks; the next save works
    fail_on_rank(rank, 1)
    engine.save_checkpoint(str(root / "fail"), async_save=True)
    with pytest.raises(CheckpointError, match=r"rank 1: writing .*OSError: disk full"):
        engine.wait_checkpoint()
    engine.save_checkpoint(str(root / "fail"), async_save=True)
    engine.close()  # waits for it
    assert (root / "fail" / "latest").read_text() == "global_step4"
    # (3) ZeRO-3 loads the async ZeRO-2 checkpoint: same state, rank 0's data position everywhere
    engine = make(3, seed=7)
    engine.load_checkpoint(str(root / "s2"))
    assert_same(exported(engine), saved, "ZeRO-3 loading the async ZeRO-2 save")
    assert engine.training_dataloader.sampler.position == 100
    train(engine, rank, world, range(2, 3))
    state_dict = engine.consolidated_state_dict()
    engine.save_checkpoint(str(root / "s3"))
    if rank == 0:
        torch.save(state_dict, root / "s3.pt")
    engine.close()


def test_async_save_on_two_ranks_and_offline_export(tmp_path: Path) -> None:
    spawn.run(two_ranks, 2, str(tmp_path), timeout_s=120)
    # ZeRO-2 checkpoint -> .safetensors fp32 -> the plain module, strict
    out = tmp_path / "s2.safetensors"
    assert cli(["checkpoint", "export", str(tmp_path / "s2"), str(out)]) == 0
    want = torch.load(tmp_path / "s2.pt", weights_only=True)
    got = safetensors.torch.load_file(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    model = GPT(CFG)
    model.load_state_dict(got)
    assert model.head.weight is model.wte.weight  # still tied after loading both names
    # ZeRO-3 checkpoint (partitioned parameters) -> .pt bf16
    out = tmp_path / "s3.pt"
    ckpt = tmp_path / "s3" / "global_step3"  # a checkpoint directory, not its save directory
    assert cli(["checkpoint", "export", str(ckpt), str(out), "--dtype", "bf16"]) == 0
    want = torch.load(tmp_path / "s3.pt", weights_only=True)
    got = torch.load(out, weights_only=True)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].bfloat16()) for k in want)
    GPT(CFG).load_state_dict(got)
