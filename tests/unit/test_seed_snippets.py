"""The seed document's code snippets (/work/shared/seed, FEATURES.md lists them), each as written
with only `deepspeed` replaced by `hybrid_ray`, at world size 1 on small random data.

The one other change: section 3.2.1's `HybridModel().cuda()` is `.cuda()`-free when there is no
GPU. Section 4.2's CustomLossScaler is exercised in test_loss_scaling_engine.py (seed_examples.py).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import hybrid_ray as deepspeed  # noqa: F401  (the snippets' `import deepspeed`)

SEED_DS_CONFIG = {  # section 2.3, verbatim
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "weight_decay": 0.01}},
    "fp16": {"enabled": True, "loss_scale_window": 1000, "initial_scale_power": 16},
}

# ---- section 3.1.1, as written ---------------------------------------------------------------
from hybrid_ray.runtime.fp16.layer import FP16_Layer  # noqa: E402


class HybridModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = FP16_Layer(nn.Linear(768, 3072))  # FP16计算层
        self.linear2 = nn.Linear(3072, 768)             # FP32计算层
    def forward(self, x):
        x = self.linear1(x)
        x = self.linear2(x)
        return x


# ---- section 3.1.2, as written (the method's class is ours) -----------------------------------
from hybrid_ray.runtime.utils import checkpoint_activations  # noqa: E402


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.block2 = nn.Linear(16, 4)

    @checkpoint_activations(checkpoint_in_fp32=True)
    def forward_with_checkpoint(self, x):
        # 启用混合精度检查点
        x = self.block1(x)
        x = self.block2(x)
        return x

    def forward(self, x):
        return self.forward_with_checkpoint(x)


# ---- section 6.1, as written ------------------------------------------------------------------
from hybrid_ray.runtime.fp16.layer import FP16_Module  # noqa: E402


class CustomFP16Layer(FP16_Module):
    def __init__(self, module):
        super().__init__(module)
    def forward(self, x):
        # 自定义前向逻辑
        x = self.module(x)
        return x.half()  # 强制返回FP16


def test_hybrid_model_initialize_and_training_loop(tmp_path, monkeypatch) -> None:
    """Sections 2.3, 3.1.1, 3.2.1, 3.2.2 and 6.3 together, as the seed strings them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds_config.json").write_text(json.dumps(SEED_DS_CONFIG))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 768, generator=g), torch.randn(8, 768, generator=g)) for _ in range(2)]
    dataloader = data
    criterion = nn.MSELoss()
    # 3.2.1
    model = HybridModel().cuda() if torch.cuda.is_available() else HybridModel()
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=None,
        model=model,
        model_parameters=model.parameters(),
        config_params="ds_config.json"
    )
    # 6.3
    from hybrid_ray.profiling.speedometer import Speedometer
    speedometer = Speedometer(
        args=None,
        model_engine=model_engine,
        interval=100,
        mp_size=1
    )
    # 3.2.2
    losses = []
    for epoch in range(10):
        model_engine.train()
        for batch in dataloader:
            inputs, labels = batch
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            speedometer.update(loss.item())
            losses.append(loss.item())
    assert model_engine.fp16_enabled() and model_engine.global_steps == 20
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_checkpoint_activations_decorator() -> None:
    torch.manual_seed(0)
    m = Blocks()
    x = torch.randn(4, 16, requires_grad=True)
    m(x).sum().backward()
    ref = m.block2(m.block1(x.detach().requires_grad_()))
    assert m.block1[0].weight.grad is not None and ref.shape == (4, 4)


def test_custom_fp16_layer() -> None:
    out = CustomFP16Layer(nn.Linear(8, 8))(torch.randn(2, 8))
    assert out.dtype == torch.float16 and out.shape == (2, 8)


def test_flops_profiler_snippet(capsys) -> None:
    """Section 5.2 unpacks two values; DeepSpeed's get_model_profile (and ours, which keeps its
    signature) returns three, (flops, macs, params): as written the snippet fails in DeepSpeed
    too, after printing the report. The three-name form is checked alongside."""
    model = HybridModel()
    # 5.2, as written
    from hybrid_ray.profiling.flops_profiler import get_model_profile
    with pytest.raises(ValueError, match="too many values to unpack"):
        flops, params = get_model_profile(
            model=model,
            input_shape=(1, 768),
            print_per_layer_stat=True
        )
    assert "HybridModel" in capsys.readouterr().out
    flops, macs, params = get_model_profile(model=model, input_shape=(1, 768), print_per_layer_stat=True)
    assert params == sum(p.numel() for p in model.parameters())
    assert flops == 2 * macs > 0 and capsys.readouterr().out.strip()


def test_zero3_offload_snippet() -> None:
    """Section 4.3's ZeRO-3 + CPU optimizer offload call, as written, names no batch size:
    DeepSpeed refuses that ("Either train_batch_size or train_micro_batch_size_per_gpu needs to
    be provided"), and so does hybrid_ray, with a ConfigError naming both keys. With the seed's
    micro-batch (section 2.3) added it builds; the call returns the 4-tuple, as DeepSpeed's."""
    model = HybridModel()
    with pytest.raises(deepspeed.ConfigError, match="train_micro_batch_size_per_gpu"):
        model_engine = deepspeed.initialize(
         model=model,
         config_params={
             "zero_optimization": {
                 "stage": 3,
                 "offload_optimizer": {"device": "cpu"}
             }
         }
        )
    model_engine = deepspeed.initialize(
     model=model,
     config_params={
         "train_micro_batch_size_per_gpu": 8,
         "zero_optimization": {
             "stage": 3,
             "offload_optimizer": {"device": "cpu"}
         }
     }
    )
    assert len(model_engine) == 4 and model_engine[0].zero_optimization_stage() == 3
