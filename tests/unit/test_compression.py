"""Gradient compression without a process group: config, top-k selection, error feedback, warm-up."""
from __future__ import annotations

import pytest
import torch

from hybrid_ray.config import ConfigError, load_config
from hybrid_ray.engine.compression import CommStats, TopK


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return str(info.value)


@pytest.mark.parametrize("kind", ["none", "topk", "fp16", "bf16"])
def test_supported_types_load(kind):
    cfg = load_config({"gradient_compression": {"type": kind, "topk_ratio": 0.1, "warmup_steps": 5,
                                                "error_feedback": False}})
    assert cfg.gradient_compression.type == kind


@pytest.mark.parametrize("raw, message", [
    ({"gradient_compression": {"type": "gzip"}}, "gradient_compression.type: "),
    ({"gradient_compression": {"topk_ratio": 0}}, "gradient_compression.topk_ratio: out of range; got 0"),
    ({"gradient_compression": {"warmup_steps": -1}}, "gradient_compression.warmup_steps: out of range"),
    ({"gradient_compression": {"error_feedbak": True}},
     "gradient_compression.error_feedbak: unknown key; did you mean 'error_feedback'?"),
    ({"gradient_compression": {"type": "fp16"}, "communication_data_type": "bf16"},
     "gradient_compression.type, communication_data_type: contradiction; got 'fp16' and 'bf16'"),
])
def test_config_errors_name_the_key(raw, message):
    assert error_of(raw).startswith(message)


def test_half_compression_agrees_with_equal_communication_dtype():
    cfg = load_config({"gradient_compression": {"type": "bf16"}, "communication_data_type": "bf16"})
    assert cfg.communication_data_type == "bf16"


def test_select_keeps_largest_and_residual_is_the_rest_exactly():
    topk = TopK(0.25)
    grad = torch.tensor([1.0, -8.0, 2.0, 0.5, 3.0, -4.0, 0.0, 1.5])
    idx, values = topk.select((0, 0), grad)
    assert sorted(idx.tolist()) == [1, 5]
    dense = torch.zeros(8).index_add_(0, idx.long(), values)
    assert torch.equal(dense + topk.residuals[(0, 0)], grad)
    assert grad[1] == -8.0  # the caller's buffer is never modified


def test_error_feedback_sum_sent_plus_residual_equals_sum_of_gradients():
    # Integer-valued gradients: every sum is exact in fp32, so the identity holds bit for bit.
    topk, g = TopK(0.05), torch.Generator().manual_seed(0)
    sent, true = torch.zeros(500), torch.zeros(500)
    norms = []
    for _ in range(200):
        grad = torch.randint(-50, 51, (500,), generator=g).float()
        true += grad
        idx, values = topk.select((0, 3), grad)
        sent.index_add_(0, idx.long(), values)
        topk.on_step(False, 1.0)
        norms.append(topk.residual_norm())
    assert torch.equal(sent + topk.residuals[(0, 3)], true)
    assert max(norms[100:]) < 2 * max(norms[:100])  # bounded: no growth with the step count


def test_without_error_feedback_no_residual_is_kept():
    topk = TopK(0.1, error_feedback=False)
    topk.select((0, 0), torch.randn(100))
    assert topk.residuals == {}


def test_warmup_density_decays_exponentially_to_ratio():
    topk = TopK(0.01, warmup_steps=4)
    densities = []
    for _ in range(6):
        densities.append(topk.density())
        topk.on_step(False, 1.0)
    assert densities[0] == 1.0
    assert densities[2] == pytest.approx(0.1)  # 0.01 ** (2/4)
    assert densities[4:] == [0.01, 0.01]
    assert TopK(0.01).k_for(1000) == 10 and TopK(0.01).k_for(10) == 1


def test_residual_follows_loss_scale_and_is_dropped_on_overflow():
    topk = TopK(0.5)
    topk.select((0, 0), torch.tensor([4.0, 1.0]))
    topk.on_step(False, 0.5)  # loss scale halved: the residual is in the old units
    assert torch.equal(topk.residuals[(0, 0)], torch.tensor([0.0, 0.5]))
    topk.on_step(True, 0.5)
    assert topk.residuals == {}


def test_stats_report_the_last_step():
    stats = CommStats()
    stats.add(10, 400)
    stats.add(10, 400)
    stats.end_step()
    assert stats.summary()["ratio"] == 40 and stats.summary()["bytes_sent"] == 20
    stats.end_step()
    assert stats.summary()["ratio"] == 1.0 and stats.summary()["total_bytes_sent"] == 20
