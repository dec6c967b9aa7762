"""A process's first engine, paid ahead: what a warm spare does while it waits."""
from __future__ import annotations

from typing import Any

import torch

from .engine import Engine
from .topology import Topology


def warm_up(device: Any) -> None:
    """One training step of a throwaway engine on `device`, alone (no process group): the
    first engine a process builds pays imports made on first use and, on a GPU, the kernels'
    and libraries' start (0.6 s on this CPU, seconds on a GPU); a warm spare pays it while it
    waits instead of after a worker was lost."""
    device = torch.device(device)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
           "bf16": {"enabled": device.type == "cuda"}}
    with Engine(model, cfg, topology=Topology(0, 1, device)) as engine:
        engine.backward(engine(torch.randn(2, 8, device=device)).float().square().mean())
        engine.step()
