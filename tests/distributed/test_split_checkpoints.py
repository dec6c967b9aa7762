"""Checkpoints of a split model do not depend on the layout: saved at (tensor, pipeline,
data-parallel) = (2, 2, 2), a checkpoint loads at (1,1,1), (1,2,2), (2,1,2), (2,1,4) and (1,1,8), at
another ZeRO stage too, and saving again there writes the same tensors bit for bit (every
parameter whole with its optimizer state, under the unsplit model's names); loaded back at
(2, 2, 2) it is the same again, and training on from it matches training on from the original."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hybrid_ray as deepspeed
from hybrid_ray.engine.checkpoint import read as cread
from hybrid_ray.engine.checkpoint import storage as cio
from tests.distributed import spawn
from tests.distributed.test_pipeline import micro_batches as pipeline_batches
from tests.distributed.test_tensor_parallel import GAS, PLAN, config, pipeline

pytestmark = [pytest.mark.dist, pytest.mark.slow]


SAMPLES = 8  # per micro-batch, over every data-parallel rank: the same batch at every layout


def engine_at(world: int, tp: int, pp: int, zero: int):
    dp = world // (tp * pp)
    cfg = {**config(tp, pp, 1, zero), "train_micro_batch_size_per_gpu": SAMPLES // dp}
    return deepspeed.initialize(model=pipeline(), config=cfg, tp_plan=PLAN)[0]


def micro_batches(step: int, dp: int, d: int):
    return pipeline_batches(step, dp, d, count=GAS, samples=SAMPLES)


def train(engine, steps: range) -> list:
    dp, d = engine.dp_world_size, engine.dp_rank
    return [engine.train_batch(iter(micro_batches(s, dp, d))).item() for s in steps]


def first_run(rank: int, world: int, out: str) -> None:
    """(2,2,2): 2 steps, save, 1 more step (the continuation every layout must reproduce)."""
    engine = engine_at(world, 2, 2, 1)
    train(engine, range(2))
    engine.save_checkpoint(f"{out}/a", tag="s2")
    losses = train(engine, range(2, 3))
    if rank == 0:
        Path(out, "continued.json").write_text(json.dumps(losses))
    engine.destroy()


def reload(rank: int, world: int, out: str, src: str, dst: str, tp: int, pp: int, zero: int) -> None:
    """Load at (tp, pp, world / (tp*pp)), save again unchanged, then train one step."""
    engine = engine_at(world, tp, pp, zero)
    path, _ = engine.load_checkpoint(f"{out}/{src}", tag="s2")
    assert path is not None and engine.global_steps == 2
    engine.save_checkpoint(f"{out}/{dst}", tag="s2")
    losses = train(engine, range(2, 3))
    if rank == 0:
        Path(out, f"{dst}.json").write_text(json.dumps(losses))
    engine.destroy()


def contents(ckpt: Path) -> tuple:
    """Every tensor of a checkpoint by name, and the meta fields that must survive a reload."""
    fs, root = cio.filesystem(str(ckpt))
    manifest = cread.read_manifest(fs, root)
    tensors = {}
    names = [n for n in sorted(manifest["files"]) if not n.endswith(".json")]
    for name, data in cread.iter_verified(fs, root, manifest, names):
        tensors.update(cread.parse_tensors(data, root, name))
    meta = json.loads((ckpt / cread.META).read_text())
    index = sorted((p["name"], p["shape"], p["keys"]) for p in meta["params"])
    return tensors, index, {k: meta[k] for k in ("counters", "optimizer_scalars", "lr_scheduler", "module")}


def assert_same(a: Path, b: Path) -> None:
    ta, ia, ma = contents(a)
    tb, ib, mb = contents(b)
    assert ia == ib and ma == mb
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def test_a_split_checkpoint_loads_at_any_layout(tmp_path: Path) -> None:
    out = str(tmp_path)
    spawn.run(first_run, 8, out, timeout_s=120)
    saved = tmp_path / "a" / "s2"
    tensors, index, _ = contents(saved)
    names = {name for name, _, _ in index}
    assert names == set(dict(pipeline().named_parameters()))  # the unsplit model's names, whole
    assert {tuple(shape) for name, shape, _ in index if name == "1.fc1.weight"} == {(64, 16)}
    assert "1.fc1.weight/exp_avg" in tensors
    continued = json.loads((tmp_path / "continued.json").read_text())
    for dst, world, tp, pp, zero in [("b111", 1, 1, 1, 0), ("b122", 4, 1, 2, 2), ("b212", 4, 2, 1, 3),
                                     ("b214", 8, 2, 1, 2), ("b118", 8, 1, 1, 3)]:
        spawn.run(reload, world, out, "a", dst, tp, pp, zero, timeout_s=120)
        assert_same(saved, tmp_path / dst / "s2")
        losses = json.loads((tmp_path / f"{dst}.json").read_text())
        assert losses == pytest.approx(continued, rel=1e-5), dst
    # and back: the one-process checkpoint at (2, 2, 2)
    spawn.run(reload, 8, out, "b111", "c222", 2, 2, 1, timeout_s=120)
    assert_same(saved, tmp_path / "c222" / "s2")
    assert json.loads((tmp_path / "c222.json").read_text()) == continued
