"""Speedometer: records every `interval` optimizer steps with throughput from the engine's
counters, TFLOPS from measured flops, MFU against the peak table, and memory."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import hybrid_ray
from hybrid_ray.profiling import peaks, speedometer as sp

B, D_IN, HIDDEN, D_OUT = 4, 16, 32, 8
TRAIN_FLOPS = 2 * B * (D_IN * HIDDEN + HIDDEN * D_OUT) * 3 - 2 * B * D_IN * HIDDEN  # fwd + bwd


def _engine(**cfg):
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT))
    config = {"train_micro_batch_size_per_gpu": B, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config.update(cfg)
    engine, *_ = hybrid_ray.initialize(model, config=config)
    return engine


def _step(engine) -> torch.Tensor:
    loss = ((engine(torch.randn(B, D_IN)) - torch.randn(B, D_OUT)) ** 2).mean()
    engine.backward(loss)
    engine.step()
    return loss


def test_reports_every_interval_with_measured_flops(capsys):
    engine = _engine()
    seen = []
    meter = hybrid_ray.Speedometer(engine, interval=3, peak_flops=1e12, on_report=seen.append)
    records = [meter.update(_step(engine)) for _ in range(12)]
    # Update 1 starts the clock and asks for a profile (micro-steps 2 and 3); update 3 adopts its
    # flops and restarts the window; reports follow every 3 optimizer steps.
    got = [(i + 1, r["step"]) for i, r in enumerate(records) if r is not None]
    assert got == [(6, 6), (9, 9), (12, 12)]
    assert seen == [r for r in records if r is not None] and meter.last is seen[-1]
    r = seen[-1]
    assert meter.flops_per_sample == TRAIN_FLOPS / B
    assert r["samples"] == 12 * B and r["world_size"] == 1 and r["loss"] > 0
    assert r["tflops"] == pytest.approx(TRAIN_FLOPS / B * r["samples_per_s"] / 1e12)
    assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / 1e12)
    assert r["tokens_per_s"] is None  # float inputs: no sequence dimension
    assert r["mem_allocated_gib"] > 0 and r["mem_peak_gib"] >= r["mem_allocated_gib"]
    assert r["step_time_s"] == pytest.approx(B / r["samples_per_s"], rel=1e-6)
    assert capsys.readouterr().out.count("samples/s") == 3


def test_mfu_unknown_on_cpu():
    engine = _engine()
    meter = hybrid_ray.Speedometer(engine, interval=2, verbose=False)
    records = [meter.update(_step(engine).item()) for _ in range(6)]
    r = [x for x in records if x][-1]
    assert r["tflops"] > 0 and r["mfu"] is None and meter.peak_flops is None


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_throughput_arithmetic_with_accumulation_and_tokens(monkeypatch):
    # A duck-typed engine and a fake clock: 8 samples per optimizer step over 2 micro-steps,
    # 0.5 s per optimizer step, 128 tokens per sample, 1 GFLOP per sample, 4 ranks.
    clock = _Clock()
    monkeypatch.setattr(sp.time, "perf_counter", clock)
    engine = SimpleNamespace(global_steps=0, global_samples=0,
                             topology=SimpleNamespace(world_size=4, rank=1), device=torch.device("cpu"))
    meter = hybrid_ray.Speedometer(model_engine=engine, interval=2, peak_flops=4e9,
                                   flops_per_sample=1e9, tokens_per_sample=128, args=None, mp_size=1)
    out = []
    for micro in range(1, 13):  # the seed's loop calls update once per batch
        clock.t += 0.25
        engine.global_samples += 4
        engine.global_steps = micro // 2
        out.append(meter.update(loss=1.0))
    records = [r for r in out if r]
    assert [r["step"] for r in records] == [2, 4, 6]
    r = records[-1]
    assert r["samples_per_s"] == pytest.approx(16.0) and r["tokens_per_s"] == pytest.approx(2048.0)
    assert r["step_time_s"] == pytest.approx(0.5)
    assert r["tflops"] == pytest.approx(16.0 * 1e9 / 4 / 1e12)  # per device
    assert r["mfu"] == pytest.approx(1.0)
    assert r["loss"] == 1.0


def test_tokens_inferred_from_token_ids():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

        def forward(self, ids):
            return self.head(self.emb(ids))

    engine, *_ = hybrid_ray.initialize(LM(), config={"train_micro_batch_size_per_gpu": 2,
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    meter = hybrid_ray.Speedometer(engine, interval=2, verbose=False)
    records = []
    for _ in range(7):
        ids = torch.randint(0, 50, (2, 12))
        logits = engine(ids)
        loss = nn.functional.cross_entropy(logits.view(-1, 50), ids.view(-1))
        engine.backward(loss)
        engine.step()
        records.append(meter.update(loss))
    record = records[-1]
    assert meter.tokens_per_sample == 12
    assert record["tokens_per_s"] == pytest.approx(12 * record["samples_per_s"])
    assert meter.flops_per_sample == 3 * 2 * 12 * 16 * 50  # the head: forward, weight and input grads


def test_argument_errors():
    with pytest.raises(ValueError, match="engine: missing"):
        hybrid_ray.Speedometer()
    engine = SimpleNamespace(global_steps=0, global_samples=0)
    with pytest.raises(ValueError, match="interval: out of range; got 0"):
        hybrid_ray.Speedometer(engine, interval=0)
    with pytest.raises(ValueError, match="mp_size: not supported; got 2"):
        hybrid_ray.Speedometer(engine, mp_size=2)


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
    ("NVIDIA H200", torch.bfloat16, 989e12),
    ("NVIDIA H100 PCIe", torch.float16, 756e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, 67e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
    ("NVIDIA A100-PCIE-40GB", torch.float32, 19.5e12),
    ("NVIDIA A10G", torch.bfloat16, 125e12),
    ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA L40S", torch.bfloat16, 362e12),
    ("NVIDIA L40", torch.bfloat16, None),
    ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),
    ("Tesla T4", torch.float16, 65e12),
    ("cpu", torch.float32, None),
])
def test_peak_table(name, dtype, expected):
    assert peaks.peak_flops(name, dtype) == expected


def test_peak_table_tf32():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # fp32 matmuls may use TF32 tensor cores
    try:
        assert peaks.peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12
        assert peaks.peak_flops("Tesla V100-SXM2-16GB", torch.float32) == 15.7e12  # no TF32 there
    finally:
        torch.set_float32_matmul_precision(before)


def test_format_record():
    line = sp.format_record(dict(step=5, loss=1.5, samples_per_s=10.0, tokens_per_s=None, tflops=1.25,
                                 mfu=0.4, mem_allocated_gib=1.0, mem_peak_gib=2.0))
    assert line == ("step 5 | loss 1.5000 | 10.0 samples/s | 1.25 TFLOPS/device | MFU 40.0% | "
                    "mem 1.00 GiB (peak 2.00)")
