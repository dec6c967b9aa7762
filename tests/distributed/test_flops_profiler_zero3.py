"""The engine's flops profile under ZeRO-3 on 2 gloo ranks: parameters are empty tensors between
uses, so the profiler must read their counts while each module runs; flops are per rank."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]
MICRO, D = 2, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run(rank: int, world: int) -> None:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1},
           "flops_profiler": {"enabled": True, "profile_step": 1}}
    engine = Engine(Net(), cfg, topology=Topology.from_environment(torch.device("cpu")))
    assert engine.stage3 is not None
    for _ in range(3):
        loss = engine(torch.randn(MICRO, D)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    p = engine.flops_profiler.last
    linear = 2 * MICRO * D * D
    forward = 3 * linear + 2 * MICRO * D * 4
    # Backward: weight grads everywhere, input grads for all but the first layer.
    assert p.flops == forward + (2 * forward - linear), p.flops
    assert p.modules["blocks.0"].params == D * D + D
    assert p.modules[""].params == 3 * (D * D + D) + D * 4 + 4
    engine.close()


def test_zero3_profile_counts_gathered_parameters():
    spawn.run(run, 2, timeout_s=60)
