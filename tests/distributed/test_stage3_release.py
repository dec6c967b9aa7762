"""ZeRO stage 3 frees a unit's gathered parameters between its forward and its backward.

Autograd saves views of the weights it needs in backward (a linear layer keeps `weight.t()`, a
tensor-parallel layer a DTensor over its shard). A view holds its storage, so releasing a unit
by pointing its parameters elsewhere freed nothing until backward: every unit stayed whole
through the forward. The checks below look at what autograd saved during a forward: every saved
view of a unit's flat buffer must hold zero bytes once the forward is over (while the unit is
released), and the step must still train as the reference does, since backward reads the
re-gathered values through those same views.
"""
from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import hybrid_ray as deepspeed
from hybrid_ray.models.gpt import GPT, GPTConfig
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def storage_id(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.untyped_storage()._cdata


def saved_bytes_of_units(engine, step) -> List[int]:
    """Run `step` (a forward) recording what autograd saves; return the bytes each saved view
    of a unit's parameters still holds afterwards."""
    saved: List[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    spaces = [s for u in engine.stage3.units for s in u.spaces]
    flats = {s.flat.untyped_storage()._cdata for s in spaces}
    assert not any(u.gathered for u in engine.stage3.units)
    held = [(t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().nbytes()
            for t in saved if storage_id(t) in flats]
    engine.backward(loss)
    engine.step()
    return held


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def plain(rank: int, world: int, precision: dict) -> None:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}, **precision}
    engine = deepspeed.initialize(model=Blocks(), config=cfg)[0]
    for step in range(3):
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(step * world + rank))
        held = saved_bytes_of_units(engine, lambda: engine(x))
        assert len(held) >= 3 and held == [0] * len(held), held  # weight views of blocks 1-3 at least
    engine.destroy()


@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_units_hold_no_memory_between_forward_and_backward(precision) -> None:
    spawn.run(plain, 2, precision, timeout_s=90)


def split_gpt(rank: int, world: int) -> None:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
           "tensor_model_parallel_size": 2}
    model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=64, seq_len=16, bias=False))
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    for step in range(2):
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step * 2 + engine.dp_rank))
        held = saved_bytes_of_units(engine, lambda: engine(tokens[:, :-1], tokens[:, 1:]))
        assert len(held) >= 4 and held == [0] * len(held), held
    engine.destroy()


def test_tensor_parallel_units_hold_no_memory_between_forward_and_backward() -> None:
    # (T, dp) = (2, 2): the blocks' split weights are seen through DTensor views while they run
    spawn.run(split_gpt, 4, timeout_s=120)
