"""Activation checkpointing on a CUDA device: lower peak memory, the same gradients.

Skipped where no GPU is present (CI); run on a GPU machine with `pytest tests/gpu`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import pytest
import torch

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT, GPT_SIZES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = dataclasses.replace(GPT_SIZES["small"], dropout=0.1)
BATCH = 32


def step(ac: Optional[dict]) -> Tuple[int, float, Dict[str, torch.Tensor]]:
    """Peak bytes allocated by one bf16 forward/backward above what the engine holds, loss, grads."""
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if ac is not None:
        cfg["activation_checkpointing"] = ac
    engine = Engine(GPT(CFG), cfg, topology=Topology(0, 1, torch.device("cuda", 0)))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(1)  # the dropout masks
    loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {n: p.grad.float().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    return peak, loss.item(), grads


def test_checkpointing_lowers_peak_memory_with_close_grads() -> None:
    plain_peak, plain_loss, plain = step(None)
    ckpt_peak, ckpt_loss, ckpt = step({"enabled": True})
    cpu_peak, cpu_loss, cpu = step({"enabled": True, "cpu_checkpointing": True})
    print(f"\nGPT small bf16, {BATCH} x {CFG.seq_len} tokens, peak bytes above the engine's own: "
          f"{plain_peak:,} plain, {ckpt_peak:,} checkpointed ({plain_peak / ckpt_peak:.2f}x less), "
          f"{cpu_peak:,} checkpointed with cpu_checkpointing")
    assert ckpt_peak < 0.7 * plain_peak
    assert cpu_peak <= ckpt_peak
    assert ckpt_loss == plain_loss == cpu_loss
    for name in plain:  # same kernels, same RNG: equal up to nondeterministic reductions
        torch.testing.assert_close(ckpt[name], plain[name], rtol=2e-2, atol=1e-4, msg=name)
        torch.testing.assert_close(cpu[name], plain[name], rtol=2e-2, atol=1e-4, msg=name)
