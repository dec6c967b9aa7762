"""offload_optimizer.overlap_step in one process: config rules, the same update as the step
after backward (bf16, a precision switch, an optimizer it cannot run), and the inverse update
(2 gloo ranks: tests/distributed/test_backward_step.py)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from hybrid_ray import NotSupportedError
from hybrid_ray.engine import Engine
from hybrid_ray.engine.zero.backward_step import BackwardStep, _Space
from tests.distributed.test_offload import config, params
from tests.unit.test_offload import error_of, train as train_offload

STEPS = 5


def overlapped(cfg: dict, previous: bool = False) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["zero_optimization"]["offload_optimizer"].update(overlap_step=True, clip_with_previous_norm=previous)
    return cfg


def train(cfg: dict, gas: int = 1) -> Engine:
    return train_offload(cfg, gas, STEPS)


def same(a: Engine, b: Engine) -> bool:
    pa, pb = params(a), params(b)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    return all(torch.equal(pa[n], pb[n]) for n in pa) and \
        all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_config_refuses_overlap_step_with_the_delayed_update_or_replicas() -> None:
    both = {"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "overlap_step": True, "delayed_param_update": True}}}
    assert error_of(both, NotSupportedError).startswith("zero_optimization.offload_optimizer.overlap_step: ")
    replicas = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "overlap_step": True}},
                "fault_tolerance": {"replicas": 1}}
    assert error_of(replicas, NotSupportedError).startswith(
        "fault_tolerance.replicas, zero_optimization.offload_optimizer.overlap_step: not supported together")


@pytest.mark.parametrize("precision, gas", [("fp32", 2), ("bf16", 1)])
def test_one_rank_overlap_is_the_same_update(precision: str, gas: int) -> None:
    cfg = config(2, gas, 0.0, False, {}, precision)
    plain, over = train(cfg, gas), train(overlapped(cfg), gas)
    assert same(plain, over)
    assert over.zero.backward_step.overlapped == STEPS - 1


def test_a_precision_switch_rebuilds_the_overlapped_step() -> None:
    cfg = config(2, 1, 0.0, False, {}, "bf16")
    cfg["precision"] = {"schedule": [{"step": 2, "dtype": "fp32"}]}
    plain, over = train(cfg), train(overlapped(cfg))
    assert over.base_dtype == "fp32" and same(plain, over)
    # The new engine layout's first step creates nothing new: the state carried over.
    assert over.zero.backward_step.overlapped >= 1


def test_what_keeps_the_step_after_backward_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    clip = config(2, 1, 0.05, False, {})
    sgd = config(2, 1, 0.0, False, {})
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}
    for cfg, words in ((clip, "gradient_clipping needs this step's norm"), (sgd, "the optimizer is SGD")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
            over = train(overlapped(cfg))
        said = [r.getMessage() for r in caplog.records if "overlap_step" in r.getMessage()]
        assert len(said) == 1 and words in said[0], said
        assert over.zero.backward_step.overlapped == 0 and same(train(cfg), over)


@pytest.mark.parametrize("decoupled, wd", [(True, 0.1), (False, 0.1), (False, 0.0)])
def test_the_inverse_update_restores_master_and_moments(decoupled: bool, wd: float) -> None:
    torch.manual_seed(0)
    n = 10_000
    # Moments of the gradient's scale (Adam's L2 term, 0.1 x |p|, included), as in training.
    p, m, v = torch.randn(n), torch.randn(n) * 1e-2, torch.rand(n) * 1e-2 + 1e-3
    grad = torch.randn(n) * 1e-2
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    master = torch.nn.Parameter(p.clone())
    opt = cls([master], lr=1e-2, weight_decay=wd, betas=(0.9, 0.95), fused=True)
    master.grad = torch.zeros(n)
    opt.step()  # creates the state; then set it to the values under test
    state = opt.state[master]
    state["exp_avg"].copy_(m), state["exp_avg_sq"].copy_(v), state["step"].fill_(7)
    master.detach().copy_(p)
    space = _Space(master.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                   {k: x for k, x in opt.param_groups[0].items() if k != "params"}, decoupled, None)
    bs = BackwardStep.__new__(BackwardStep)
    bs.coef = 0.5
    g = grad.clone()
    bs._step(space, 100, g[100:9000])  # a slice, as a bucket: the rest untouched
    assert not torch.equal(master.detach(), p)
    BackwardStep._undo(space, 100, g[100:9000])
    for got, want in ((master.detach(), p), (state["exp_avg"], m), (state["exp_avg_sq"], v)):
        assert (got - want).norm() <= 1e-6 * want.norm(), (got - want).abs().max()
    assert torch.equal(master.detach()[:100], p[:100]) and torch.equal(master.detach()[9000:], p[9000:])
    assert int(state["step"]) == 7


def test_a_backward_cut_short_is_undone_before_the_next_one() -> None:
    """An error late in a boundary backward (after buckets stepped): the retried backward
    first rolls those steps back, and the run ends as the plain engine's doing the same."""
    from tests.distributed.test_offload import batch
    ends = []
    for cfg in (config(2, 1, 0.0, False, {}), overlapped(config(2, 1, 0.0, False, {}))):
        engine = train_offload(cfg, 1, 2)  # the second step overlaps
        fail = {"on": True}

        def boom(grad: torch.Tensor) -> torch.Tensor:
            if fail["on"]:
                fail["on"] = False
                raise RuntimeError("injected")
            return grad
        engine.module.wte.weight.register_hook(boom)  # the last gradient of backward
        with pytest.raises(RuntimeError, match="injected"):
            engine.backward(engine(*batch(2, 0, 0, 1)))
        engine.zero_grad()
        engine.backward(engine(*batch(2, 0, 0, 1)))
        engine.step()
        ends.append((params(engine), engine))
    (plain, _), (over, engine) = ends
    assert engine.zero.backward_step.rolled_back > 0 and engine.zero.backward_step.overlapped == 2
    for n in plain:
        assert (over[n] - plain[n]).norm() <= 1e-6 * plain[n].norm(), n
