"""LR sequences of the DeepSpeed warmup schedules against hand-written formulas.

Convention under test: ``seq[k]`` is the lr after k ``scheduler.step()`` calls, which
DeepSpeed computes at ``last_batch_iteration i = k - 1`` (``i = -1`` at construction).
"""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from hybrid_ray.engine.schedulers import (
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

LOG10 = math.log(10)


def make_optimizer(lrs: tuple = (0.1, 0.2)) -> torch.optim.Optimizer:
    """SGD with one param group per lr, so per-group behaviour is visible."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lr_sequence(sched: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[list[float]]:
    """Group lrs now and after each of ``steps`` (optimizer.step, scheduler.step) pairs."""
    opt = sched.optimizer
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        opt.step()
        sched.step()
        seq.append([g["lr"] for g in opt.param_groups])
    return seq


def cfg(kind: str, **params: object) -> types.SimpleNamespace:
    """A stand-in for the scheduler config dataclass."""
    return types.SimpleNamespace(type=kind, params=params)


def test_warmup_lr_log_overrides_optimizer_lr() -> None:
    sched = build_scheduler(cfg("WarmupLR", warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10), make_optimizer())
    seq = lr_sequence(sched, 14)
    expected = {
        0: 0.01,  # i = -1: construction sets the warmup start
        1: 0.01,  # i = 0: log(1) = 0
        2: 0.01 + 0.09 * math.log(2) / LOG10,
        5: 0.01 + 0.09 * math.log(5) / LOG10,
        9: 0.01 + 0.09 * math.log(9) / LOG10,
        10: 0.1,  # i = 9: log(10) / log(10)
        11: 0.1,
        14: 0.1,
    }
    for k, lr in expected.items():
        assert seq[k] == pytest.approx([lr, lr], abs=1e-12), k  # both groups: absolute lrs
    assert sched.get_last_lr() == pytest.approx([0.1, 0.1])


def test_warmup_lr_linear_per_group_bounds() -> None:
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=4, warmup_type="linear")
    seq = lr_sequence(sched, 7)
    for k in range(8):
        g = min(1.0, max(0, k - 1) / 4)  # i = k - 1; i = -1 gives the min
        assert seq[k] == pytest.approx([0.0 + 1.0 * g, 0.1 + 0.4 * g]), k
    assert seq[4] == pytest.approx([0.75, 0.4])  # i = 3: 3/4 of the way
    assert seq[5] == pytest.approx([1.0, 0.5])  # i = 4: warmup done


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type: str) -> None:
    opt = make_optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.1,
                          warmup_num_steps=5, warmup_type=warmup_type)
    seq = lr_sequence(sched, 25)
    for k in (1, 2, 3, 4, 5):
        i = k - 1
        g = math.log(i + 1) / math.log(5) if warmup_type == "log" else i / 5
        assert seq[k][0] == pytest.approx(0.1 * g), k
    assert seq[6][0] == pytest.approx(0.1)  # i = 5: (20 - 5) / 15
    assert seq[11][0] == pytest.approx(0.1 * 10 / 15)  # i = 10
    assert seq[20][0] == pytest.approx(0.1 * 1 / 15)  # i = 19
    assert seq[21][0] == 0.0 and seq[25][0] == 0.0  # zero at and after total_num_steps
    assert all(a == b for a, b in seq)  # absolute lrs: both groups identical


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_is_ratio_of_each_group_lr(warmup_type: str) -> None:
    opt = make_optimizer((0.1, 0.2))
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=5,
                           cos_min_ratio=0.01, warmup_type=warmup_type)
    seq = lr_sequence(sched, 24)

    def ratio(i: int) -> float:
        if i < 5:
            g = math.log(i + 1) / math.log(5) if warmup_type == "log" else i / 5
            return 0.1 + 0.9 * g
        p = min(1.0, (i - 5 + 1) / 15)
        return 0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2

    assert seq[0] == [0.0, 0.0]  # i = -1, as DeepSpeed
    for k in (1, 3, 5, 6, 8, 13, 19, 20, 21, 24):
        r = ratio(k - 1)
        assert seq[k] == pytest.approx([0.1 * r, 0.2 * r], abs=1e-12), k
    assert seq[1] == pytest.approx([0.01, 0.02])  # warmup starts at warmup_min_ratio
    assert seq[20] == pytest.approx([0.001, 0.002])  # i = 19: progress 1 -> cos_min_ratio
    assert seq[24] == pytest.approx([0.001, 0.002])  # and it stays there


@pytest.mark.parametrize(
    "kind, params",
    [
        ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=6)),
        ("WarmupDecayLR", dict(total_num_steps=15, warmup_num_steps=4, warmup_type="linear")),
        ("WarmupCosineLR", dict(total_num_steps=15, warmup_num_steps=4, warmup_min_ratio=0.2)),
    ],
)
def test_state_dict_resume_is_identical(kind: str, params: dict) -> None:
    reference = build_scheduler(cfg(kind, **params), make_optimizer())
    full = lr_sequence(reference, 18)

    first = build_scheduler(cfg(kind, **params), make_optimizer())
    lr_sequence(first, 7)
    saved_sched = first.state_dict()
    saved_opt = first.optimizer.state_dict()

    # Resume with the optimizer state restored, as a checkpoint would.
    opt = make_optimizer()
    resumed = build_scheduler(cfg(kind, **params), opt)
    opt.load_state_dict(saved_opt)
    resumed.load_state_dict(saved_sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()" warning
        tail = lr_sequence(resumed, 11)
    assert tail == full[7:]  # exactly: same formula at the same index

    # Resume into a fresh optimizer: loading the scheduler alone restores the lrs.
    bare = build_scheduler(cfg(kind, **params), make_optimizer())
    bare.load_state_dict(saved_sched)
    assert lr_sequence(bare, 11) == full[7:]


def test_state_dict_holds_progress_only() -> None:
    sched = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_num_steps=2)
    lr_sequence(sched, 4)
    state = sched.state_dict()
    assert set(state) == {"last_epoch", "_step_count", "_last_lr"}
    # A longer run on resume keeps the progress but uses the new total.
    longer = WarmupDecayLR(make_optimizer(), total_num_steps=100, warmup_num_steps=2)
    longer.load_state_dict(state)
    assert longer.schedule_index == 3
    assert sched.get_last_lr()[0] == pytest.approx(0.001 * 7 / 8)
    assert longer.get_last_lr()[0] == pytest.approx(0.001 * 97 / 98)


def test_build_scheduler_defaults_and_none() -> None:
    assert build_scheduler(None, make_optimizer()) is None
    sched = build_scheduler(cfg("WarmupLR"), make_optimizer())
    assert isinstance(sched, WarmupLR)
    assert (sched.min_lrs, sched.max_lrs) == ([0.0, 0.0], [0.001, 0.001])
    assert (sched.warmup_num_steps, sched.warmup_type) == (1000, "log")
    # total_num_steps past the default 1000 warm-up steps: the config loader refuses less.
    cos = build_scheduler(cfg("WarmupCosineLR", total_num_steps=5000), make_optimizer())
    assert (cos.warmup_min_ratio, cos.cos_min_ratio, cos.warmup_num_steps) == (0.0, 0.0001, 1000)


def test_build_scheduler_errors_name_the_key() -> None:
    # The config loader's rules: a name is matched ignoring case, so only a misspelling fails.
    with pytest.raises(ValueError, match=r"scheduler\.type.*'WarmupLR'"):
        build_scheduler(cfg("WarmupLRx"), make_optimizer())
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_max_lrr.*'warmup_max_lr'"):
        build_scheduler(cfg("WarmupLR", warmup_max_lrr=0.1), make_optimizer())
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps"):
        build_scheduler(cfg("WarmupDecayLR"), make_optimizer())
    with pytest.raises(ValueError, match="warmup_type"):
        build_scheduler(cfg("WarmupLR", warmup_type="cosine"), make_optimizer())
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(make_optimizer(), warmup_num_steps=-1)
    with pytest.raises(ValueError, match="param groups"):
        WarmupLR(make_optimizer(), warmup_max_lr=[0.1, 0.2, 0.3])


@pytest.mark.parametrize("steps", [0, 1])
def test_short_warmup_is_lifted_to_two(steps: int) -> None:
    # log(1) would divide by zero; DeepSpeed treats warmup_num_steps 0 and 1 as 2, and the
    # config schema accepts 0 as DeepSpeed does.
    seq = lr_sequence(WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=steps), 3)
    assert [s[0] for s in seq] == pytest.approx([0.0, 0.0, 1.0, 1.0])
    assert build_scheduler(cfg("WarmupLR", warmup_num_steps=steps), make_optimizer()) is not None


def test_params_may_be_a_dataclass() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Params:
        total_num_steps: int = 30
        warmup_num_steps: int = 3
        warmup_type: str = "linear"

    sched = build_scheduler(types.SimpleNamespace(type="WarmupDecayLR", params=Params()), make_optimizer())
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 30
    assert lr_sequence(sched, 2)[2][0] == pytest.approx(0.001 / 3)
