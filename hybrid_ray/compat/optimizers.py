"""`deepspeed.ops.adam`: DeepSpeed's CPU and fused Adam under their names and signatures. They are
torch's Adam/AdamW (whose foreach/fused kernels are the fast path on either device), so a script
that builds one and hands it to `initialize(optimizer=...)` trains as it does under DeepSpeed; the
engine keeps fp32 masters whatever the model's dtype, which is what `fp32_optimizer_states` asks."""
from __future__ import annotations

from typing import Any, Iterable, Tuple

import torch

from ..config import NotSupportedError


def _check(name: str, bias_correction: bool, weight_decay: float) -> None:
    if not bias_correction:  # torch's Adam always corrects: a silent difference otherwise
        raise NotSupportedError(f"{name}(bias_correction=False): not supported; torch's Adam, which "
                                "it runs on here, always applies bias correction")
    if weight_decay < 0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")


class DeepSpeedCPUAdam(torch.optim.Adam):
    """`DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode=True, fp32_optimizer_states=True)`: AdamW (decoupled weight decay) by default,
    Adam with L2 decay when `adamw_mode=False`."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check(type(self).__name__, bias_correction, weight_decay)
        self.adamw_mode = bool(adamw_mode)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=self.adamw_mode)


class FusedAdam(torch.optim.Adam):
    """`FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode=True, weight_decay,
    amsgrad=False, set_grad_none=True)`: AdamW by default, Adam with L2 decay when
    `adam_w_mode=False`; AMSGrad is refused, as DeepSpeed's kernel refuses it."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise NotSupportedError("FusedAdam(amsgrad=True): FusedAdam does not support the AMSGrad "
                                    "variant (as in DeepSpeed); use torch.optim.Adam(amsgrad=True)")
        _check(type(self).__name__, bias_correction, weight_decay)
        self.adamw_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=self.adamw_mode)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none and set_to_none)
