"""Optimizer offload in one process: config rules, parity, delayed update, memory, relayout.

One rank has nothing to reduce: the engine streams each bucket's gradient to the host from the
same hooks as a reduction would (tests/distributed/test_offload.py covers 2 and 4 ranks).
"""
from __future__ import annotations

import pytest
import torch

from hybrid_ray import ConfigError, NotSupportedError, load_config
from hybrid_ray.engine import Engine
from hybrid_ray.engine.zero.offload import cpu_optimizer_kwargs, frozen_hyperparameters
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT
from tests.distributed.test_offload import CFG, STEPS, batch, config, max_rel_err, params, reference

ONE = Topology(0, 1, torch.device("cpu"))


def error_of(raw: dict, cls: type) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    return str(info.value)


# ---- config -----------------------------------------------------------------------------
def test_offload_needs_zero_stage_1_or_2() -> None:
    raw = {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    assert error_of(raw, ConfigError) == (
        "zero_optimization.offload_optimizer.device: needs ZeRO stage 1 or higher; got 'cpu'; "
        "set zero_optimization.stage to 1 or 2, or offload_optimizer.device to 'none'")
    for stage in (1, 2):
        zero = load_config({"train_batch_size": 1, "zero_optimization": {
            "stage": stage, "offload_optimizer": {
                "device": "cpu", "pin_memory": True, "delayed_param_update": True}}}).zero_optimization
        assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.delayed_param_update


def test_nvme_and_parameter_offload_are_not_supported() -> None:
    nvme = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    assert error_of(nvme, NotSupportedError).startswith(
        "zero_optimization.offload_optimizer.device: not supported yet; got 'nvme'; allowed: 'none', 'cpu'")
    param = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    assert error_of(param, NotSupportedError).startswith(
        "zero_optimization.offload_param.device: not supported yet; got 'cpu'")


# ---- training ---------------------------------------------------------------------------
def train(cfg: dict, gas: int, steps: int = STEPS) -> Engine:
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), cfg, topology=ONE)
    for step in range(steps):
        for k in range(gas):
            engine.backward(engine(*batch(step, k, 0, 1)))
            engine.step()
    return engine


@pytest.mark.parametrize("stage, gas, clip, delayed, extra", [
    (1, 1, 0.0, False, {}),
    (2, 2, 0.05, False, {}),
    (2, 2, 0.05, False, {"overlap_comm": False}),  # buckets copied after backward instead
    (1, 1, 0.0, True, {}),
    (2, 3, 0.05, True, {}),
])
def test_one_rank_offload_matches_adamw(stage: int, gas: int, clip: float, delayed: bool,
                                        extra: dict) -> None:
    engine = train(config(stage, gas, clip, delayed, extra), gas)
    engine.finish_delayed_update()
    err = max_rel_err(params(engine), reference(1, gas, clip, delayed))
    assert err < 5e-6, err
    assert all(m.device.type == "cpu" for m in engine.zero.masters)
    # The masters are host buffers of their own, not views of the (CPU) parameters.
    flat_ptrs = {s.flat.data_ptr() for s in engine.spaces}
    assert all(m.data_ptr() not in flat_ptrs for m in engine.zero.masters)


def test_delayed_update_lands_only_when_asked() -> None:
    engine = train(config(2, 1, 0.0, True, {}), 1)
    before = params(engine)
    assert engine.zero.offload.runner.busy
    engine.finish_delayed_update()
    assert not engine.zero.offload.runner.busy
    assert max_rel_err(params(engine), before) > 0  # the last update arrived
    engine.finish_delayed_update()  # nothing left: a no-op
    engine.close()


def test_memory_breakdown_reports_host_bytes() -> None:
    cfg = config(2, 1, 1.0, False, {}, "bf16")
    cfg["precision"] = {"norms_fp32": False}
    engine = train(cfg, 1)
    n = sum(p.numel() for p in engine.module.parameters())
    per = {k: v / n for k, v in engine.memory_breakdown().items()}
    # One rank keeps its whole bf16 gradient (nothing to partition): 2 + 2 bytes on the device.
    assert per["params"] == pytest.approx(2, rel=0.02) and per["grads"] == pytest.approx(2, rel=0.02)
    assert per["master_params"] == per["master_grads"] == per["optimizer_state"] == 0
    assert per["host_master_params"] == pytest.approx(4, rel=0.02)
    assert per["host_master_grads"] == pytest.approx(4, rel=0.02)
    assert per["host_optimizer_state"] == pytest.approx(8, rel=0.02)


def test_precision_switch_keeps_offloaded_state() -> None:
    cfg = config(2, 1, 0.0, True, {}, "bf16")
    cfg["precision"] = {"schedule": [{"step": 2, "dtype": "fp32"}]}
    engine = train(cfg, 1)
    assert engine.base_dtype == "fp32" and engine.zero.offload is not None
    state = engine.optimizer.state[engine.zero.masters[0]]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].abs().sum() > 0
    engine.finish_delayed_update()  # the last update may still be running: read after it
    assert int(state["step"]) == STEPS


def test_cpu_optimizer_is_fused_and_hyperparameters_are_snapshotted() -> None:
    assert cpu_optimizer_kwargs(torch.optim.AdamW) == {"fused": True}
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.5, fused=True)
    view = frozen_hyperparameters(opt)
    opt.param_groups[0]["lr"] = 0.1  # the scheduler, while the view's step runs
    p.grad = torch.ones(4)
    view.step()
    assert view.param_groups[0]["lr"] == 0.5 and opt.state[p]["exp_avg"].sum() > 0  # shared state


def test_large_cpu_gradient_norm_is_accurate() -> None:
    from hybrid_ray.engine.zero.norms import ROWS_FROM as _ROWS_FROM, cpu_square_sum as _cpu_square_sum
    torch.manual_seed(0)
    g = torch.randn(_ROWS_FROM + 12345) * 1e-3 + 1e-4  # rows path plus a tail
    exact = (g.double() ** 2).sum()
    assert abs(_cpu_square_sum([g, g[:100]]) - exact - (g[:100].double() ** 2).sum()) < 1e-6 * exact
    assert _cpu_square_sum([torch.tensor([float("inf")] * (1 << 16))]).isinf()


def test_to_host_converts_slice_by_slice_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masters are converted to fp32 into their host buffer in slices (no whole-shard fp32
    temporary on the device): every element, across slice boundaries and a short last slice."""
    from hybrid_ray.engine.zero import offload as off
    monkeypatch.setattr(off, "_CONVERT_SLICE", 7)
    host = off.HostOffload(torch.device("cpu"), pin_memory=False, delayed=False)
    src = torch.randn(5, 9).to(torch.bfloat16)
    out = host.to_host(src, torch.float32)
    assert out.dtype == torch.float32 and out.shape == src.shape
    assert torch.equal(out, src.float()) and out.data_ptr() != src.data_ptr()
    same = host.to_host(src)
    assert same.dtype == torch.bfloat16 and torch.equal(same, src)
