"""Loss scaling and non-finite gradients through the engine (single process, CPU).

A scripted run multiplies the loss by inf at chosen steps; the engine must skip exactly those
steps, leave parameters, optimizer and LR schedule untouched, and move the loss scale by
DeepSpeed's rule. tests/unit/test_loss_scaler.py checks the scalers alone; this file checks
that the engine drives them correctly.
"""
from __future__ import annotations

import logging
from typing import Iterable, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybrid_ray
from hybrid_ray import LossScaleUnderflowError, NonFiniteGradientError
from tests.seed_examples import CustomLossScaler  # the seed's section 4.2 class, verbatim

T, F_ = True, False
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                         "warmup_num_steps": 100, "warmup_type": "linear"}}




def make_engine(dtype: str = "fp16", loss_scaler: object = None, **extra: object):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    cfg: dict = {"train_micro_batch_size_per_gpu": 4, "scheduler": WARMUP,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    engine, *_ = hybrid_ray.initialize(model, config=cfg, loss_scaler=loss_scaler)
    return engine


def poisoned_step(engine: hybrid_ray.Engine, step: int, bad: bool, poison: float = float("inf")) -> bool:
    """One optimizer step; with `bad` the loss is multiplied by inf/nan. True if applied."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = F.mse_loss(engine(x), y)
    engine.backward(loss * poison if bad else loss)
    engine.step()
    return engine.was_step_applied()


class Watch:
    """Per step: were params, optimizer state and the LR schedule left alone?"""

    def __init__(self, engine: hybrid_ray.Engine) -> None:
        self.engine = engine
        self.params = [p.detach().clone() for p in engine.module.parameters()]
        self.masters = [m.detach().clone() for m in engine.zero.masters]
        self.sched_epoch = engine.lr_scheduler.last_epoch
        self.lr = engine.get_lr()
        self.adam_steps = [s["step"].item() for s in engine.optimizer.state.values()]

    def untouched(self) -> bool:
        e = self.engine
        return (all(torch.equal(p, b) for p, b in zip(e.module.parameters(), self.params))
                and all(torch.equal(m, b) for m, b in zip(e.zero.masters, self.masters))
                and e.lr_scheduler.last_epoch == self.sched_epoch and e.get_lr() == self.lr
                and [s["step"].item() for s in e.optimizer.state.values()] == self.adam_steps)


def run_script(engine: hybrid_ray.Engine, flags: Iterable[bool], poison: float = float("inf")) -> List[float]:
    """Apply the overflow script; check each step; return the loss scale after each step."""
    scales = []
    skipped = 0
    for step, bad in enumerate(flags):
        watch = Watch(engine)
        applied = poisoned_step(engine, step, bad, poison)
        assert applied == (not bad), step
        assert watch.untouched() == bad, step
        skipped += bad
        assert engine.skipped_steps == skipped and engine.global_steps == step + 1
        scales.append(engine.loss_scale)
    return scales


def skip_messages(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hybrid_ray" and "skipped" in r.getMessage()]


# ---- fp16 dynamic scaling ----------------------------------------------------------------

def test_dynamic_scale_sequence_with_hysteresis_and_short_window(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hybrid_ray")
    engine = make_engine(fp16={"initial_scale_power": 8, "loss_scale_window": 4, "hysteresis": 2})
    assert engine.loss_scale == 256
    flags = [F_, F_, F_, F_, T, T, F_, F_, F_, F_, T, F_, T, F_, F_, F_, F_]
    # it3: 4th clean update -> x2. it4: overflow spends hysteresis (kept). it5: halves.
    # it9: 4 clean updates after it5 -> x2, hysteresis refilled. it10 spends it, it11 clean
    # does not refill it (not consecutive_hysteresis), so it12 halves. it16: x2.
    expected = [256, 256, 256, 512, 512, 256, 256, 256, 256, 512, 512, 512, 256, 256, 256, 256, 512]
    assert run_script(engine, flags) == expected
    assert skip_messages(caplog) == [
        "step 4: gradient overflow, step skipped; loss scale 512 -> 512",
        "step 5: gradient overflow, step skipped; loss scale 512 -> 256",
        "step 10: gradient overflow, step skipped; loss scale 512 -> 512",
        "step 12: gradient overflow, step skipped; loss scale 512 -> 256",
    ]


def test_nan_loss_is_skipped_like_inf() -> None:
    engine = make_engine(fp16={"initial_scale_power": 8, "hysteresis": 1})
    assert run_script(engine, [F_, T, F_], poison=float("nan")) == [256, 128, 128]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    engine = make_engine(fp16={"initial_scale_power": 8, "loss_scale_window": 100,
                               "hysteresis": 2, "consecutive_hysteresis": True})
    # Isolated overflows never halve; two in a row do.
    assert run_script(engine, [T, F_, T, F_, T, T]) == [256, 256, 256, 256, 256, 128]


def test_underflow_at_min_scale_raises_with_advice() -> None:
    engine = make_engine(fp16={"initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1})
    assert run_script(engine, [T, T]) == [2, 1]
    watch = Watch(engine)
    with pytest.raises(LossScaleUnderflowError) as info:
        poisoned_step(engine, 2, True)
    msg = str(info.value)
    for advice in ("initial_scale_power", "loss_scale_window", "gradient_clipping", "bf16"):
        assert advice in msg, advice
    assert watch.untouched() and engine.loss_scale == 1


def test_custom_loss_scaler_drives_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hybrid_ray")
    scaler = CustomLossScaler(init_scale=2**4)
    engine = make_engine(loss_scaler=scaler)
    assert engine.loss_scale == 16
    scales = run_script(engine, [F_, F_, T, F_, T, T, F_])
    assert scales == [32, 64, 32, 64, 32, 16, 32]
    assert engine.loss_scale == scaler.current_scale == 32
    assert skip_messages(caplog) == [
        "step 2: gradient overflow, step skipped; loss scale 64 -> 32",
        "step 4: gradient overflow, step skipped; loss scale 64 -> 32",
        "step 5: gradient overflow, step skipped; loss scale 32 -> 16",
    ]


def test_the_scale_really_multiplies_the_gradients() -> None:
    # Same run at two initial scales: the unscaled gradient norm and the update agree.
    a = make_engine(fp16={"initial_scale_power": 4})
    b = make_engine(fp16={"initial_scale_power": 12})
    for step in range(2):
        poisoned_step(a, step, False)
        poisoned_step(b, step, False)
        assert a.get_global_grad_norm() == pytest.approx(b.get_global_grad_norm(), rel=1e-2)
    assert a.loss_scale == 16 and b.loss_scale == 4096


# ---- bf16 and fp32: no scaler, skip and stop -----------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_non_finite_steps_are_skipped_then_stop(precision: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hybrid_ray")
    engine = make_engine(precision, precision={"max_consecutive_skipped_steps": 3})
    assert engine.loss_scale == 1.0
    # Two bad steps, one good one (resets the count), two bad: still under the limit.
    assert run_script(engine, [F_, T, T, F_, T, T]) == [1.0] * 6
    warnings = [r for r in caplog.records if r.name == "hybrid_ray" and r.levelno == logging.WARNING]
    assert [m.split(":")[0] for m in skip_messages(caplog)] == ["step 1", "step 2", "step 4", "step 5"]
    assert len(warnings) == 4
    assert "1 in a row, limit 3" in warnings[2].getMessage()
    assert "2 in a row, limit 3" in warnings[3].getMessage()
    watch = Watch(engine)
    with pytest.raises(NonFiniteGradientError, match="3 consecutive steps"):
        poisoned_step(engine, 6, True)
    assert watch.untouched() and engine.skipped_steps == 5


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_skipped_step_leaves_no_trace(precision: str) -> None:
    # Batch 1 poisoned, then retried clean: the same weights, moments and LR schedule as a run
    # that never saw the poisoned batch (fp16: hysteresis 2 keeps the scale, so even the
    # rounding is the same).
    engine, reference = make_engine(precision), make_engine(precision)
    for data, bad in [(0, False), (1, True), (1, False), (2, False)]:
        poisoned_step(engine, data, bad)
    for data in range(3):
        poisoned_step(reference, data, False)
    assert engine.global_steps == 4 and engine.skipped_steps == 1
    assert engine.get_lr() == reference.get_lr() and engine.loss_scale == reference.loss_scale
    for p, q in zip(engine.module.parameters(), reference.module.parameters()):
        assert torch.equal(p, q)
    for m, r in zip(engine.zero.masters, reference.zero.masters):
        state, ref_state = engine.optimizer.state[m], reference.optimizer.state[r]
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
