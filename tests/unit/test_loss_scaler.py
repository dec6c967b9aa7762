"""Scripted overflow sequences against the exact scale sequence each scaler must produce."""

from __future__ import annotations

import json
import types
from typing import Iterable

import pytest

from hybrid_ray.engine.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    LossScaleUnderflowError,
    NoLossScaler,
    StaticLossScaler,
    UserLossScaler,
    build_loss_scaler,
)
from tests.seed_examples import CustomLossScaler  # the seed's section 4.2 class, verbatim

T, F = True, False


def run(scaler: LossScaler, flags: Iterable[bool]) -> list[float]:
    """Apply the overflow flags in order; return the scale after each update."""
    scales = []
    for flag in flags:
        scaler.update(flag)
        scales.append(scaler.loss_scale)
    return scales




def test_defaults_match_deepspeed() -> None:
    s = DynamicLossScaler()
    assert s.loss_scale == 2**16 and s.dynamic
    assert (s.scale_factor, s.scale_window, s.min_scale, s.hysteresis) == (2.0, 1000, 1.0, 2)
    assert s.consecutive_hysteresis is False


def test_hysteresis_two_first_overflow_only_spends_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=16, hysteresis=2)
    # it0 spends hysteresis; it1..it2 halve (hysteresis stays at 1); it3 clean, no refill
    # outside a window boundary; it4 halves again.
    assert run(s, [T, T, T, F, T]) == [16, 8, 4, 4, 2]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    s = DynamicLossScaler(init_scale=16, hysteresis=2, consecutive_hysteresis=True)
    assert run(s, [T, T, T, F, T]) == [16, 8, 4, 4, 4]


@pytest.mark.parametrize(
    "consecutive, expected", [(True, [16, 16, 16, 16, 16]), (False, [16, 16, 8, 8, 4])]
)
def test_alternating_overflows_both_hysteresis_modes(consecutive: bool, expected: list) -> None:
    s = DynamicLossScaler(init_scale=16, hysteresis=2, scale_window=3, consecutive_hysteresis=consecutive)
    assert run(s, [T, F, T, F, T]) == expected


def test_window_boundary_refills_hysteresis_when_not_consecutive() -> None:
    s = DynamicLossScaler(init_scale=16, hysteresis=2, scale_window=3)
    # it0 spends hysteresis (last overflow 0); it3: (3 - 0) % 3 == 0 -> grow and refill,
    # so it4 only spends hysteresis and it5 halves.
    assert run(s, [T, F, F, F, T, T]) == [16, 16, 16, 32, 32, 16]
    s = DynamicLossScaler(init_scale=16, hysteresis=2, scale_window=3)
    # Without reaching the window, the clean steps do not refill: it3 halves.
    assert run(s, [T, F, F, T]) == [16, 16, 16, 8]


def test_window_doubling_after_exactly_scale_window_clean_steps() -> None:
    s = DynamicLossScaler(init_scale=16, hysteresis=1, scale_window=4)
    assert run(s, [F] * 8) == [16, 16, 16, 32, 32, 32, 32, 64]
    # Overflow at it8 halves; the next growth is 4 clean steps later, at it12.
    assert run(s, [T, F, F, F, F]) == [32, 32, 32, 32, 64]


def test_window_one_grows_every_clean_step() -> None:
    s = DynamicLossScaler(init_scale=16, hysteresis=1, scale_window=1)
    assert run(s, [F, F, T, F]) == [32, 64, 32, 64]


def test_min_scale_floor_then_underflow_error() -> None:
    s = DynamicLossScaler(init_scale=4, min_scale=3, hysteresis=1)
    assert run(s, [T]) == [3]  # max(4 / 2, 3): clamped at the floor
    before = s.state_dict()
    with pytest.raises(LossScaleUnderflowError) as info:
        s.update(True)
    assert s.state_dict() == before  # nothing changed: the caller may still checkpoint
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.iteration, err.scale, err.min_scale) == (1, 3, 3)
    msg = str(err)
    for hint in ("fp16.initial_scale_power", "fp16.loss_scale_window", "gradient_clipping", "bf16.enabled"):
        assert hint in msg
    assert "\n" not in msg  # one paragraph


def test_underflow_only_when_no_hysteresis_left() -> None:
    s = DynamicLossScaler(init_scale=2, min_scale=1, hysteresis=2)
    assert run(s, [T, T]) == [2, 1]  # spend hysteresis, then halve onto the floor
    with pytest.raises(LossScaleUnderflowError):
        s.update(True)
    s = DynamicLossScaler(init_scale=1, min_scale=1, hysteresis=2)
    assert run(s, [T]) == [1]  # at the floor already, but hysteresis is left: no error
    with pytest.raises(LossScaleUnderflowError):
        s.update(True)


def test_updates_spend_hysteresis_shrink_and_grow() -> None:
    s = DynamicLossScaler(hysteresis=2, scale_window=2)

    def after(flag: bool) -> tuple:
        s.update(flag)
        return s.cur_iter, s.last_overflow_iter, s.loss_scale, s.cur_hysteresis

    assert after(True) == (1, 0, 65536, 1)  # it0: scale kept, one unit of hysteresis spent
    assert after(True) == (2, 1, 32768, 1)  # it1: no hysteresis left, halved
    assert after(False) == (3, 1, 32768, 1)  # it2: nothing changes
    assert after(False) == (4, 1, 65536, 2)  # it3: (3 - 1) % 2 == 0: grown, hysteresis refilled


def test_state_dict_round_trip_mid_sequence_continues_identically() -> None:
    flags = [(i * 7919) % 11 in (0, 3) for i in range(60)]
    kwargs = dict(init_scale=2**10, scale_window=5, hysteresis=2, min_scale=0.25)
    a = DynamicLossScaler(**kwargs)
    run(a, flags[:23])
    b = DynamicLossScaler(**kwargs)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # plain types only
    states_a, states_b = [], []
    for flag in flags[23:]:
        a.update(flag)
        b.update(flag)
        states_a.append(a.state_dict())
        states_b.append(b.state_dict())
        assert a.loss_scale == b.loss_scale
    assert states_a == states_b and len({st["cur_scale"] for st in states_a}) > 1


def test_state_from_another_kind_is_ignored() -> None:
    s = DynamicLossScaler(init_scale=16)
    s.load_state_dict(StaticLossScaler(8).state_dict())
    assert s.loss_scale == 16


def test_invalid_dynamic_args_name_the_argument() -> None:
    with pytest.raises(ValueError, match="scale_window"):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)


def test_static_scaler_reports_overflow_but_never_changes() -> None:
    s = StaticLossScaler(128)
    assert not s.dynamic
    assert run(s, [T, F, T, T, F]) == [128] * 5
    s = StaticLossScaler(128)
    s.update(False)
    s.update(True)
    assert s.loss_scale == 128 and s.state_dict() == {"kind": "static", "iteration": 2}


def test_no_loss_scaler() -> None:
    s = NoLossScaler()
    assert s.loss_scale == 1.0 and not s.dynamic
    assert run(s, [T, F]) == [1.0, 1.0]
    assert s.scale_loss(3.0) == 3.0


def test_user_adapter_with_seed_class() -> None:
    s = UserLossScaler(CustomLossScaler())
    assert s.loss_scale == 2**16 and s.dynamic
    assert s.scale_loss(2.0) == 2.0**17
    assert run(s, [T, F, F]) == [32768, 65536, 131072]
    assert s.state_dict()["iteration"] == 3
    state = json.loads(json.dumps(s.state_dict()))
    assert state["user_state"] == {"current_scale": 131072, "scale_factor": 2, "unscaled_loss": 0}
    fresh = UserLossScaler(CustomLossScaler())
    fresh.load_state_dict(state)
    assert fresh.loss_scale == 131072
    fresh.update(True)
    assert fresh.loss_scale == 65536 and fresh.state_dict()["iteration"] == 4


def test_user_adapter_alternative_names_and_own_state_dict() -> None:
    class Other:
        def __init__(self) -> None:
            self.cur_scale = 8.0
            self.calls = []

        def update(self, overflow: bool) -> None:
            self.calls.append(overflow)
            self.cur_scale = 4.0 if overflow else self.cur_scale

        def state_dict(self) -> dict:
            return {"s": self.cur_scale}

        def load_state_dict(self, d: dict) -> None:
            self.cur_scale = d["s"]

    obj = Other()
    s = UserLossScaler(obj)
    assert run(s, [F, T]) == [8.0, 4.0] and obj.calls == [False, True]
    assert s.state_dict()["user_state"] == {"s": 4.0}
    t = UserLossScaler(Other())
    t.load_state_dict(s.state_dict())
    assert t.loss_scale == 4.0


def test_user_adapter_reads_loss_scale_property() -> None:
    class WithProperty:
        def __init__(self) -> None:
            self._s = 4.0

        @property
        def loss_scale(self) -> float:
            return self._s

        def update_scale(self, has_overflow: bool) -> None:
            self._s /= 2 if has_overflow else 1

    assert run(UserLossScaler(WithProperty()), [T]) == [2.0]


def test_user_adapter_names_what_is_missing() -> None:
    with pytest.raises(TypeError) as info:
        UserLossScaler(object())
    msg = str(info.value)
    assert "current_scale" in msg and "cur_scale" in msg and "loss_scale" in msg
    assert "update_scale(has_overflow)" in msg and "update(overflow)" in msg
    only_scale = types.SimpleNamespace(current_scale=1.0)
    with pytest.raises(TypeError, match="update_scale") as info:
        UserLossScaler(only_scale)
    assert "scale attribute" not in str(info.value)


def fp16_cfg(**overrides: object) -> types.SimpleNamespace:
    """A stand-in for the fp16 config dataclass, with DeepSpeed's defaults."""
    values = dict(
        loss_scale=0.0,
        initial_scale_power=16,
        loss_scale_window=1000,
        hysteresis=2,
        consecutive_hysteresis=False,
        min_loss_scale=1.0,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_build_loss_scaler_precedence() -> None:
    assert isinstance(build_loss_scaler(None, enabled=False), NoLossScaler)
    static = build_loss_scaler(fp16_cfg(loss_scale=512.0), enabled=True)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 512
    user = build_loss_scaler(fp16_cfg(), enabled=False, user_scaler=CustomLossScaler(8))
    assert isinstance(user, UserLossScaler) and user.loss_scale == 8
    mine = StaticLossScaler(4)
    assert build_loss_scaler(fp16_cfg(), enabled=True, user_scaler=mine) is mine


def test_build_loss_scaler_dynamic_from_config() -> None:
    s = build_loss_scaler(
        fp16_cfg(initial_scale_power=5, loss_scale_window=2, hysteresis=1, min_loss_scale=4.0,
                 consecutive_hysteresis=True),
        enabled=True,
    )
    assert isinstance(s, DynamicLossScaler)
    assert (s.loss_scale, s.scale_window, s.hysteresis, s.min_scale) == (32, 2, 1, 4.0)
    assert s.consecutive_hysteresis
    assert run(s, [F, F, T, T, T]) == [32, 64, 32, 16, 8]
