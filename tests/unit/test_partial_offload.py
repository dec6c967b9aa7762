"""Partial optimizer offload (offload_optimizer.ratio) in one process: the split, the parity
with no offload and with full offload, checkpoints across ratios, the config's rules.

The distributed parity (2 and 4 gloo ranks, stages 1-3, against a single-process AdamW) is in
tests/distributed/test_offload.py."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
import torch.nn as nn

import hybrid_ray
from hybrid_ray.config import ConfigError, NotSupportedError
from hybrid_ray.engine.zero import partial


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def config(ratio: Optional[object], stage: int = 2) -> dict:
    off = {"device": "cpu", "ratio": ratio} if ratio is not None else {"device": "none"}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "offload_optimizer": off}}


def train(e: hybrid_ray.Engine, steps: int, seed: int = 1) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        e.backward(e(torch.randn(4, 8, generator=g)).square().mean())
        e.step()
    return {k: v.clone() for k, v in e.module.state_dict().items()}


def test_split_takes_the_shortest_prefix_holding_the_ratio() -> None:
    ps = [nn.Parameter(torch.zeros(n)) for n in (10, 30, 60)]
    sizes = lambda part: [p.numel() for p in part]  # noqa: E731
    assert [sizes(x) for x in partial.split(ps, 0.1)] == [[10], [30, 60]]
    assert [sizes(x) for x in partial.split(ps, 0.2)] == [[10, 30], [60]]
    assert [sizes(x) for x in partial.split(ps, 1.0)] == [[10, 30, 60], []]
    assert [sizes(x) for x in partial.split(ps, 0.0)] == [[], [10, 30, 60]]


def test_auto_offloads_everything_on_a_cpu_engine() -> None:
    assert partial.resolve_ratio("auto", torch.device("cpu"), 1000) == 1.0
    assert partial.resolve_ratio(0.25, torch.device("cpu"), 1000) == 0.25


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("ratio", [0.2, 0.5, 1.0, "auto"])
def test_partial_offload_trains_as_without_offload(stage: int, ratio: object) -> None:
    want = train(hybrid_ray.initialize(model(), config=config(None, stage))[0], 5)
    e = hybrid_ray.initialize(model(), config=config(ratio, stage))[0]
    got = train(e, 5)
    host, total = partial.offloaded_numel(e.spaces)
    if ratio in (1.0, "auto"):  # the same flat layout: bit for bit
        assert host == total
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        # Within rounding: the fused CPU kernel rounds its vector body and scalar tail
        # differently, and cutting a space in two moves elements between them.
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
        assert 0 < host < total and host >= ratio * total
        assert {m.data_ptr() for m in e.zero.masters}.isdisjoint({s.flat.data_ptr() for s in e.spaces})


def test_memory_breakdown_reports_each_share_where_it_lives() -> None:
    e = hybrid_ray.initialize(model(), config=config(0.5))[0]
    train(e, 1)
    mem = e.zero.memory_breakdown()
    host, total = partial.offloaded_numel(e.spaces)
    assert mem["host_master_params"] == 4 * host and mem["master_params"] == 4 * (total - host)
    assert mem["host_optimizer_state"] == 8 * host and mem["optimizer_state"] == 8 * (total - host)


@pytest.mark.parametrize("then", [None, 1.0, 0.3])
def test_a_checkpoint_moves_between_ratios(tmp_path: Path, then: Optional[float]) -> None:
    # Saved with half the state on the host; loaded with none, all, or another share offloaded:
    # the run goes on as if it had never stopped.
    want = train(hybrid_ray.initialize(model(), config=config(0.5))[0], 6)
    first = hybrid_ray.initialize(model(), config=config(0.5))[0]
    train(first, 3)
    first.save_checkpoint(str(tmp_path))
    second = hybrid_ray.initialize(model(), config=config(then))[0]
    assert second.load_checkpoint(str(tmp_path))[0] is not None
    # the same data as the uninterrupted run's steps 4-6
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        torch.randn(4, 8, generator=g)
    for _ in range(3):
        second.backward(second(torch.randn(4, 8, generator=g)).square().mean())
        second.step()
    got = second.module.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6  # rounding: see above


def test_the_config_names_what_a_ratio_cannot_do() -> None:
    bad = config(0.5)
    bad["zero_optimization"]["offload_optimizer"]["delayed_param_update"] = True
    with pytest.raises(NotSupportedError, match="offload_optimizer.ratio"):
        hybrid_ray.initialize(model(), config=bad)
    for value in (0, 1.5, "half", True):
        with pytest.raises(ConfigError, match="offload_optimizer.ratio"):
            hybrid_ray.initialize(model(), config=config(value))
