"""Tensor parallelism (a tp_plan through torch's parallelize_module) composed with pipeline
stages and ZeRO on the data-parallel axis trains as one process does on the whole batch: at
(T, P, dp) = (2,1,1), (2,1,2), (2,2,1), (1,2,2) and (2,2,2), with ZeRO 0 to 3 on the data-parallel
axis, gradient clipping active over the whole model (fp32, relative error ~1e-5); the project's
GPT with its own plan (sequence-parallel norms, the tied embedding and head split over the
vocabulary); engine.consolidated_state_dict() gives the unsplit model's names and values."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hybrid_ray as deepspeed
from hybrid_ray.config import ConfigError
from hybrid_ray.models.gpt import GPT, GPTConfig
from hybrid_ray.pipe import LayerSpec, PipelineModule
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]
MICRO, GAS, STEPS, WIDTH = 2, 2, 3, 16
PLAN = {"*.fc1": "colwise", "*.fc2": "rowwise"}


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def layers():
    return [LayerSpec(nn.Linear, 6, WIDTH), *[LayerSpec(Residual, WIDTH) for _ in range(3)],
            LayerSpec(nn.Linear, WIDTH, 3)]


def config(tp: int, pp: int, dp: int, zero: int, schedule: str = "1f1b") -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO * (2 // dp), "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": zero}, "pipeline": {"schedule": schedule},
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}


def micro_batches(step: int, dp: int, dp_rank: int):
    """The step's micro-batches of 2 * MICRO samples, this replica's part of each."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(GAS):
        x, y = torch.randn(2 * MICRO, 6, generator=g), torch.randint(0, 3, (2 * MICRO,), generator=g)
        n = 2 * MICRO // dp
        out.append((x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]))
    return out


def pipeline() -> PipelineModule:
    torch.manual_seed(0)  # the same weights on every rank and in the one-process run
    return PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss())


def run(engine) -> list:
    dp, d = engine.dp_world_size, engine.dp_rank
    return [engine.train_batch(iter(micro_batches(s, dp, d))).item() for s in range(STEPS)]


def dump(engine, losses: list, out: str, rank: int) -> None:
    state = {k: v.tolist() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "state": state}))
    engine.destroy()


def split(rank: int, world: int, out: str, tp: int, pp: int, zero: int, schedule: str) -> None:
    dp = world // (tp * pp)
    engine = deepspeed.initialize(model=pipeline(), config=config(tp, pp, dp, zero, schedule),
                                  tp_plan=PLAN)[0]
    assert (engine.dp_world_size, engine.tp_world_size) == (dp, tp)
    assert (engine.pp_rank, engine.dp_rank, engine.tp_rank) == (rank // (dp * tp), rank // tp % dp, rank % tp)
    dump(engine, run(engine), out, rank)


def assert_like_one_process(out: Path, world: int, want_state: dict, want_losses: list,
                            rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for r in range(world):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert got["losses"] == pytest.approx(want_losses, rel=rtol, abs=atol)
        assert sorted(got["state"]) == sorted(want_state)
        for k, v in want_state.items():
            torch.testing.assert_close(torch.tensor(got["state"][k]), v.float(), rtol=rtol, atol=atol)


def reference() -> tuple:
    engine = deepspeed.initialize(model=pipeline(), config=config(1, 1, 1, 0))[0]
    losses = run(engine)
    return {k: v.float() for k, v in engine.module.state_dict().items()}, losses


@pytest.mark.parametrize("world,tp,pp,zero,schedule", [
    (2, 2, 1, 0, "1f1b"), (2, 2, 1, 3, "1f1b"), (4, 2, 1, 1, "1f1b"), (4, 2, 1, 2, "1f1b"),
    (4, 2, 1, 3, "1f1b"), (4, 2, 2, 1, "gpipe"), (4, 1, 2, 2, "1f1b"), (4, 1, 2, 3, "gpipe"),
    (8, 2, 2, 2, "1f1b"), (8, 2, 2, 3, "1f1b")])
def test_split_model_trains_as_one_process(tmp_path: Path, world, tp, pp, zero, schedule) -> None:
    spawn.run(split, world, str(tmp_path), tp, pp, zero, schedule, timeout_s=120)
    assert_like_one_process(tmp_path, world, *reference())
