"""precision.norm_activations: fp32 norms fed half activations without casts (unit, CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid_ray.config import ConfigError, load_config
from hybrid_ray.engine.precision import HalfActivationNorm, PrecisionPolicy


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.rms = nn.RMSNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rms(self.ln(self.fc(x))))


def _spy(fn, name: str, seen: dict):
    """`fn` recording the dtypes its kernel call takes and returns (inside the precision region)."""
    def call(x, *args, **kwargs):
        out = fn(x, *args, **kwargs)
        seen[name] = (x.dtype, out.dtype)
        return out
    return call


def run(norm_activations: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    torch.manual_seed(0)
    net = Net()
    plan = PrecisionPolicy(torch.bfloat16, norm_activations=norm_activations).apply(net, "cpu")
    seen: dict = {}
    with monkeypatch.context() as m:
        m.setattr(F, "layer_norm", _spy(F.layer_norm, "ln", seen))
        m.setattr(F, "rms_norm", _spy(F.rms_norm, "rms", seen))
        x = torch.randn(8, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
    out.float().square().sum().backward()
    return plan, seen, out, net


def test_half_layer_norm_takes_and_returns_half_with_fp32_params(monkeypatch) -> None:
    plan, seen, _, net = run("half", monkeypatch)
    assert seen["ln"] == (torch.bfloat16, torch.bfloat16)
    assert net.ln.weight.dtype == torch.float32 and net.ln.weight.grad.dtype == torch.float32
    assert any(isinstance(r, HalfActivationNorm) for r in plan.regions)
    # RMSNorm has no mixed-dtype fused kernel: it keeps fp32 activations
    assert seen["rms"] == (torch.float32, torch.float32)


def test_fp32_default_casts_norm_activations(monkeypatch) -> None:
    plan, seen, _, _ = run("fp32", monkeypatch)
    assert seen["ln"] == (torch.float32, torch.float32)
    assert not any(isinstance(r, HalfActivationNorm) for r in plan.regions)


def test_half_and_fp32_norm_activations_agree_to_bf16_rounding(monkeypatch) -> None:
    _, _, half, net_h = run("half", monkeypatch)
    _, _, full, net_f = run("fp32", monkeypatch)
    assert torch.allclose(half.float(), full.float(), rtol=0.02, atol=0.02)
    assert torch.allclose(net_h.ln.weight.grad, net_f.ln.weight.grad, rtol=0.05, atol=0.05)


def test_bad_norm_activations_names_the_key() -> None:
    with pytest.raises(ConfigError, match="precision.norm_activations"):
        load_config({"train_micro_batch_size_per_gpu": 1, "precision": {"norm_activations": "fp16"}})
