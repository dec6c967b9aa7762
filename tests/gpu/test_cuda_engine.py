"""The engine on a CUDA device: precision placement, parity with torch, fp16 overflow handling.

Skipped where no GPU is present (CI); run on a GPU machine with `pytest tests/gpu`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT, GPT_SIZES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = dataclasses.replace(GPT_SIZES["small"], bias=False)


def engine(extra: dict) -> Engine:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}, **extra}
    return Engine(GPT(CFG), cfg, topology=Topology(0, 1, torch.device("cuda", 0)))


def batch(step: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), device="cuda", generator=g)
    return x[:, :-1], x[:, 1:]


def test_bf16_matmuls_and_fp32_norms_on_cuda() -> None:
    e = engine({"bf16": {"enabled": True}})
    seen = {}
    blk = e.module.blocks[0]
    blk.fc.register_forward_hook(lambda m, i, o: seen.__setitem__("fc", o.dtype))
    blk.ln1.register_forward_hook(lambda m, i, o: seen.__setitem__("ln", (i[0].dtype, o.dtype)))
    loss = e(*batch(0))
    assert blk.fc.weight.dtype == torch.bfloat16 and blk.ln1.weight.dtype == torch.float32
    assert seen["fc"] == torch.bfloat16
    assert seen["ln"][1] == torch.float32  # normalisation computed and returned in fp32
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_engine_matches_fused_adamw_on_cuda(stage: int) -> None:
    e = engine({"zero_optimization": {"stage": stage}})
    torch.manual_seed(0)
    ref = GPT(CFG).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for step in range(5):
        loss = e(*batch(step))
        e.backward(loss)
        e.step()
        opt.zero_grad()
        ref(*batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    ours = dict(e.module.named_parameters())
    for name, p in ref.named_parameters():
        err = ((ours[name] - p).norm() / p.norm()).item()
        assert err < 1e-5, (name, err)


def test_fp16_overflow_is_skipped_and_scale_halves_on_cuda() -> None:
    e = engine({"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    before = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    loss = e(*batch(0))
    e.backward(loss * float("inf"))
    e.step()
    assert not e.was_step_applied() and e.skipped_steps == 1 and e.loss_scale == 128
    assert all(torch.equal(before[n], p) for n, p in e.module.named_parameters())
    first = None
    for step in range(30):
        loss = e(*batch(step % 2))
        first = first if first is not None else loss.item()
        e.backward(loss)
        e.step()
    assert e.skipped_steps == 1 and loss.item() < first


def test_half_norm_activations_on_cuda() -> None:
    """precision.norm_activations=half: bf16 in and out, fp32 statistics and fp32 master weights.

    CUDA's LayerNorm kernel needs one dtype, so the fp32 weight is cast for it (like a matmul
    weight under autocast): the output differs from the fp32 computation by bf16 rounding."""
    e = engine({"bf16": {"enabled": True}, "precision": {"norm_activations": "half"}})
    ln = e.module.blocks[0].ln1
    seen = {}
    ln.register_forward_hook(lambda m, i, o: seen.__setitem__("ln", (i[0].dtype, o.dtype)))
    loss = e(*batch(0))
    assert seen["ln"] == (torch.bfloat16, torch.bfloat16)
    e.backward(loss)
    e.step()
    assert ln.weight.dtype == torch.float32
    x = torch.randn(64, ln.weight.numel(), device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.1, 0.1)
        half = ln(x)
        full = torch.nn.functional.layer_norm(x.float(), ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() <= 2 ** -6 * full.abs().max()
