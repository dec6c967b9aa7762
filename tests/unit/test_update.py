"""The update over the masters (zero/update.py): what it multiplies, and where."""
from __future__ import annotations

import pytest
import torch

from hybrid_ray.engine.zero import update
from hybrid_ray.engine.zero.update import step_masters


def _masters_and_grads(device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in (300, 70)]
    grads = [torch.randn(m.shape, generator=gen).to(device) for m in masters]
    return masters, grads


def test_a_coefficient_of_one_multiplies_nothing_and_steps_the_same(monkeypatch) -> None:
    masters, grads = _masters_and_grads()
    ref = [m.detach().clone().requires_grad_() for m in masters]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_opt.step()
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: (calls.append(a), real(*a, **k)))
    opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    step_masters(masters, grads, 1.0, opt)
    assert calls == []
    assert all(torch.equal(m, r) for m, r in zip(masters, ref))
    step_masters(masters, grads, 0.5, opt)  # on the CPU the multiply stays outside the kernel
    assert len(calls) == 1 and not hasattr(opt, "grad_scale")


def _check_the_kernel_takes_the_coefficient(device: str) -> None:
    masters, grads = _masters_and_grads(device)
    ref = [m.detach().clone().requires_grad_() for m in masters]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    assert update._takes_grad_scale(opt, masters)
    for coef in (0.3, 0.7):
        for r, g in zip(ref, grads):
            r.grad = g * coef
        ref_opt.step()
        step_masters(masters, [g.clone() for g in grads], coef, opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        for m, r in zip(masters, ref):
            torch.testing.assert_close(m.detach(), r.detach(), rtol=1e-6, atol=1e-7)


def test_the_kernel_that_takes_the_coefficient_steps_as_the_multiply_would(monkeypatch) -> None:
    # The GPU's path, run on the CPU's fused kernel (which takes grad_scale the same way; the
    # engine folds only on a GPU): the division by 1/coef agrees with the multiply to rounding.
    monkeypatch.setattr(update, "_takes_grad_scale", lambda optimizer, masters: True)
    _check_the_kernel_takes_the_coefficient("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_fused_gpu_optimizer_takes_the_coefficient_in_its_kernel() -> None:
    _check_the_kernel_takes_the_coefficient("cuda")
