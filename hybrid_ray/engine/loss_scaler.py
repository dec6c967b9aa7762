"""Loss scalers for fp16 training: dynamic, static, none, and user-supplied.

The engine multiplies the loss by ``scaler.loss_scale`` before backward, checks the
gradients for inf/nan, agrees on one ``overflow`` flag across ranks (one small
all-reduce), skips the optimizer step if it is set, and then calls
``scaler.update(overflow)`` exactly once per optimizer boundary. Every rank therefore
runs the same sequence of updates and holds the same scale without further
communication.

The engine logs a skipped step with the scale before and after the update
("step 12: gradient overflow, step skipped; loss scale 65536 -> 32768"), which reads
the same for every kind of scaler.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = [
    "DynamicLossScaler",
    "LossScaleUnderflowError",
    "LossScaler",
    "NoLossScaler",
    "StaticLossScaler",
    "UserLossScaler",
    "build_loss_scaler",
]


def _fmt(scale: float) -> str:
    """Print whole scales without a trailing ``.0`` (65536, not 65536.0)."""
    return str(int(scale)) if float(scale).is_integer() else f"{scale:g}"


class LossScaleUnderflowError(RuntimeError):
    """Gradients overflowed while the loss scale was already at its floor."""

    def __init__(self, iteration: int, scale: float, min_scale: float) -> None:
        self.iteration = iteration
        self.scale = scale
        self.min_scale = min_scale
        super().__init__(
            f"fp16 loss scale underflow at step {iteration}: the gradients overflowed "
            f"(inf/nan) again while the loss scale was already at its minimum "
            f"{_fmt(min_scale)} (fp16.min_loss_scale), so it cannot be lowered any further "
            f"and every following step would be skipped. To recover: raise "
            f"`fp16.initial_scale_power` so training starts from a larger scale; shorten "
            f"`fp16.loss_scale_window` so the scale recovers sooner after an overflow; "
            f"enable `gradient_clipping` (e.g. 1.0) to keep gradient spikes in range; or "
            f"switch to bf16 (`bf16.enabled: true`, `fp16.enabled: false`), whose range "
            f"needs no loss scaling. Persistent overflow at scale {_fmt(scale)} usually "
            f"means a NaN in the loss or inputs, or a diverging learning rate."
        )


class LossScaler:
    """Interface the engine uses; subclasses implement ``loss_scale`` and ``update``.

    ``dynamic`` says whether the scale can change, so the engine can skip the
    overflow check's cost where nothing would react to it (bf16/fp32).
    """

    dynamic: bool = False

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the loss by before backward."""
        raise NotImplementedError

    def scale_loss(self, loss: Any) -> Any:
        """Return ``loss * loss_scale`` (a tensor op; no host sync)."""
        return loss * self.loss_scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer boundary; ``overflow`` must already agree across ranks."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Progress to checkpoint (never the configuration)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore progress saved by :meth:`state_dict`."""


class StaticLossScaler(LossScaler):
    """A constant scale (``fp16.loss_scale > 0``); overflowed steps are skipped."""

    def __init__(self, scale: float) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"StaticLossScaler: scale must be finite and > 0, got {scale!r}")
        self._scale = float(scale)
        self._iteration = 0

    @property
    def loss_scale(self) -> float:
        """The constant scale."""
        return self._scale

    def update(self, overflow: bool) -> None:
        """Count the boundary; the scale is fixed (an overflowed step is still skipped)."""
        self._iteration += 1

    def state_dict(self) -> dict:
        """Only the counter: the scale itself comes from the config on resume."""
        return {"kind": "static", "iteration": self._iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counter; state from another kind of scaler is ignored."""
        if state.get("kind") == "static":
            self._iteration = int(state["iteration"])


class NoLossScaler(StaticLossScaler):
    """bf16/fp32: scale 1.0. An overflow still skips the step, so it is still reported."""

    def __init__(self) -> None:
        super().__init__(1.0)


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaling, with hysteresis.

    The rule, applied once per ``update(overflow)`` with ``it`` the update counter
    (starting at 0) and ``last`` the iteration of the latest overflow (starting at -1):

    * overflow: if the hysteresis left is 1 (always so when ``hysteresis == 1``) the
      scale becomes ``max(scale / scale_factor, min_scale)``; otherwise one unit of
      hysteresis is spent and the scale is kept. Either way ``last = it`` and the
      step is skipped. An overflow with no hysteresis left while the scale already
      equals ``min_scale`` raises :class:`LossScaleUnderflowError`.
    * clean step: with ``consecutive_hysteresis`` the hysteresis is refilled at once
      (only *consecutive* overflows then shrink the scale). If
      ``(it - last) % scale_window == 0`` the scale is multiplied by ``scale_factor``
      and, without ``consecutive_hysteresis``, the hysteresis is refilled.

    So the first growth happens on the ``scale_window``-th clean update, and after an
    overflow at ``it = k`` the next growth happens at ``it = k + scale_window`` if
    every update in between was clean.

    Note: recent DeepSpeed releases test ``(it - last - 1) % scale_window == 0`` with
    ``it - last - 1 > 0``, i.e. grow one update later; this class keeps the original
    ``(it - last) % scale_window`` rule.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
    ) -> None:
        _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, hysteresis)
        self.init_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_scale = self.init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Apply the rule in the class docstring."""
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        """Halve the scale or spend hysteresis; raise if the scale cannot go lower."""
        if self.cur_hysteresis <= 1:
            if self.cur_scale <= self.min_scale:
                # Raising before any state changes keeps the scaler consistent for a
                # caller that catches the error, e.g. to save a diagnostic checkpoint.
                raise LossScaleUnderflowError(self.cur_iter, self.cur_scale, self.min_scale)
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        """Refill hysteresis as configured and grow the scale at window boundaries."""
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict:
        """Scale, counters and hysteresis; the window etc. come from the config."""
        return {
            "kind": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore progress. State from another kind of scaler is ignored.

        The config on resume decides the kind of scaler (one may switch from a static
        scale to dynamic scaling after trouble), so a foreign state starts fresh.
        Hysteresis is clamped in case the config lowered it since the save.
        """
        if state.get("kind") != "dynamic":
            return
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = min(int(state["cur_hysteresis"]), self.hysteresis)


def _check_dynamic_args(
    init_scale: float, scale_factor: float, scale_window: int, min_scale: float, hysteresis: int
) -> None:
    """Reject values that would make the rule meaningless, naming the argument."""
    problems = []
    if not (math.isfinite(init_scale) and init_scale > 0):
        problems.append(f"init_scale must be finite and > 0, got {init_scale!r}")
    if not (math.isfinite(scale_factor) and scale_factor > 1):
        problems.append(f"scale_factor must be finite and > 1, got {scale_factor!r}")
    if not (isinstance(scale_window, int) and scale_window >= 1):
        problems.append(f"scale_window must be an integer >= 1, got {scale_window!r}")
    if not (math.isfinite(min_scale) and min_scale > 0):
        problems.append(f"min_scale must be finite and > 0, got {min_scale!r}")
    if not (isinstance(hysteresis, int) and hysteresis >= 1):
        problems.append(f"hysteresis must be an integer >= 1, got {hysteresis!r}")
    if problems:
        raise ValueError("DynamicLossScaler: " + "; ".join(problems))


_SCALE_ATTRS = ("current_scale", "cur_scale", "loss_scale")


class UserLossScaler(LossScaler):
    """Adapts a user object such as the seed's ``CustomLossScaler``.

    The object needs a scale attribute (``current_scale``, ``cur_scale`` or
    ``loss_scale``, looked up in that order) and a method ``update_scale(has_overflow)``
    or ``update(overflow)``. The object owns the policy; this adapter only reads the
    scale and forwards overflows.
    """

    def __init__(self, obj: Any) -> None:
        self._scale_attr = next((a for a in _SCALE_ATTRS if hasattr(obj, a)), None)
        self._update_fn = getattr(obj, "update_scale", None) or getattr(obj, "update", None)
        _check_user_scaler(obj, self._scale_attr, self._update_fn)
        self.obj = obj
        self.dynamic = bool(getattr(obj, "dynamic", True))
        self._iteration = 0

    @property
    def loss_scale(self) -> float:
        """The user object's current scale, as a Python float."""
        return float(getattr(self.obj, self._scale_attr))

    def update(self, overflow: bool) -> None:
        """Forward the overflow flag to the user object."""
        self._update_fn(bool(overflow))
        self._iteration += 1

    def state_dict(self) -> dict:
        """``obj.state_dict()`` if it has one, else its plain-number attributes."""
        if callable(getattr(self.obj, "state_dict", None)):
            user_state = self.obj.state_dict()
        else:
            attrs = getattr(self.obj, "__dict__", {})
            user_state = {k: v for k, v in attrs.items() if _is_plain_number(v)}
        return {"kind": "user", "iteration": self._iteration, "user_state": user_state}

    def load_state_dict(self, state: dict) -> None:
        """Restore via ``obj.load_state_dict`` if present, else by setting attributes."""
        if state.get("kind") != "user":
            return
        self._iteration = int(state["iteration"])
        user_state = state["user_state"]
        if callable(getattr(self.obj, "load_state_dict", None)):
            self.obj.load_state_dict(user_state)
            return
        for key, value in user_state.items():
            setattr(self.obj, key, value)


def _is_plain_number(value: Any) -> bool:
    """int/float/bool: what survives a checkpoint without pickling user classes."""
    return isinstance(value, (int, float, bool))


def _check_user_scaler(obj: Any, scale_attr: Optional[str], update_fn: Any) -> None:
    """Raise a TypeError that names everything the user object lacks."""
    missing = []
    if scale_attr is None:
        missing.append("a scale attribute (one of " + ", ".join(_SCALE_ATTRS) + ")")
    if not callable(update_fn):
        missing.append("a method update_scale(has_overflow) or update(overflow)")
    if missing:
        raise TypeError(
            f"custom loss scaler {type(obj).__name__} cannot be used: it needs "
            + " and ".join(missing)
            + "."
        )


def build_loss_scaler(fp16_cfg: Any, enabled: bool, user_scaler: Any = None) -> LossScaler:
    """Choose the scaler for a run.

    ``fp16_cfg`` has ``loss_scale, initial_scale_power, loss_scale_window, hysteresis,
    consecutive_hysteresis, min_loss_scale`` (DeepSpeed's ``fp16`` section); it is not
    read when fp16 is disabled. Precedence: a user scaler (an object or an existing
    :class:`LossScaler`) always wins; fp16 disabled gives :class:`NoLossScaler`;
    ``loss_scale > 0`` gives a static scale; otherwise dynamic scaling starting at
    ``2 ** initial_scale_power``.
    """
    if user_scaler is not None:
        return user_scaler if isinstance(user_scaler, LossScaler) else UserLossScaler(user_scaler)
    if not enabled:
        return NoLossScaler()
    if fp16_cfg.loss_scale > 0:
        return StaticLossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16_cfg.initial_scale_power,
        scale_window=fp16_cfg.loss_scale_window,
        min_scale=fp16_cfg.min_loss_scale,
        hysteresis=fp16_cfg.hysteresis,
        consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
    )
