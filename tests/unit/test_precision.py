"""Per-module precision through the engine: what each module stores and computes in.

Hook ordering matters for these checks: torch runs a module's forward hooks in registration
order, and the engine registers its precision hooks in `initialize`. A hook the test registers
afterwards therefore sees what the module's forward sees (inputs already cast, autocast already
switched); a hook registered with `prepend=True` runs before the precision hook and sees the raw
input.
"""
from __future__ import annotations

import copy
import logging
from typing import Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybrid_ray
import hybrid_ray.config
from hybrid_ray.models import GPT, GPT_SIZES

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def cfg(base: str = "fp32", **precision: object) -> dict:
    out: dict = {"train_micro_batch_size_per_gpu": 4,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    if base != "fp32":
        out[base] = {"enabled": True}
    if precision:
        out["precision"] = precision
    return out


def record(module: nn.Module, seen: Dict[str, object], name: str) -> None:
    """What the module's own forward sees, inside any precision region the engine wrapped it
    in: input dtype, autocast state and dtype, output dtype."""
    holder, link = module, module.__dict__.get("forward")
    while getattr(link, "original", None) is not None:  # the innermost instance-level wrapper
        holder, link = link, link.original
    inner = link if link is not None else module.forward

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen[name + ".in"] = args[0].dtype
        seen[name + ".autocast"] = torch.is_autocast_enabled("cpu")
        seen[name + ".autocast_dtype"] = torch.get_autocast_dtype("cpu")
        out = inner(*args, **kwargs)
        seen[name + ".out"] = out.dtype
        return out

    if holder is module:
        module.forward = spy
    else:
        holder.original = spy


def train_step(engine: hybrid_ray.Engine, x: torch.Tensor) -> torch.Tensor:
    out = engine(x)
    engine.backward(out.float().square().mean())
    engine.step()
    assert engine.was_step_applied()
    return out


def masters_by_param(engine: hybrid_ray.Engine) -> Dict[int, torch.Tensor]:
    """id(param) -> its fp32 master, shaped like the parameter (one process: shard = space)."""
    out = {}
    for space, master in zip(engine.spaces, engine.zero.masters):
        for p, off in space.param_offsets():
            out[id(p)] = master.detach()[off:off + p.numel()].view_as(p)
    return out


def assert_params_are_rounded_masters(engine: hybrid_ray.Engine) -> None:
    masters = masters_by_param(engine)
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), masters[id(p)].to(p.dtype)), name


# ---- FP16Layer and FP16Module (seed 3.1.1 and 6.1) -------------------------------------------

class HybridModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = hybrid_ray.FP16Layer(nn.Linear(16, 32))
        self.linear2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.linear1(x))


def test_fp16_layer_in_an_fp32_model() -> None:
    torch.manual_seed(0)
    model = HybridModel()
    engine, *_ = hybrid_ray.initialize(model, config=cfg("fp32"))
    assert model.linear1.module.weight.dtype == FP16 and model.linear1.module.bias.dtype == FP16
    assert model.linear2.weight.dtype == FP32
    seen: Dict[str, object] = {}
    record(model.linear1.module, seen, "fp16")
    record(model.linear2, seen, "fp32")
    out = train_step(engine, torch.randn(4, 16))
    assert seen["fp16.autocast"] is True and seen["fp16.autocast_dtype"] == FP16
    assert seen["fp16.out"] == FP16  # the matmul ran in half
    # FP16Layer hands fp32 back to the fp32 caller, which computes without autocast.
    assert seen["fp32.autocast"] is False and seen["fp32.in"] == FP32 and seen["fp32.out"] == FP32
    assert out.dtype == FP32
    assert_params_are_rounded_masters(engine)
    assert all(m.dtype == FP32 for m in engine.zero.masters)


def test_fp16_layer_in_an_fp32_model_is_loss_scaled_like_a_pattern() -> None:
    torch.manual_seed(0)
    by_pattern, *_ = hybrid_ray.initialize(
        HybridModel(), config=cfg("fp32", modules={"linear1": "fp16"}))
    assert by_pattern.loss_scale == 65536.0  # the fp16 scaler with its defaults
    torch.manual_seed(0)
    by_layer, *_ = hybrid_ray.initialize(HybridModel(), config=cfg("fp32"))
    assert by_layer.loss_scale == by_pattern.loss_scale


class CustomFP16Layer(hybrid_ray.FP16Module):
    """The seed's section 6.1 example (FP16_Module is spelled FP16Module here)."""

    def __init__(self, module):
        super().__init__(module)

    def forward(self, x):
        # custom forward logic
        x = self.module(x)
        return x.half()  # force fp16 output


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.custom = CustomFP16Layer(nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.custom(torch.tanh(self.body(x)))


def test_fp16_module_subclass_keeps_its_fp16_output() -> None:
    torch.manual_seed(0)
    model = WithCustom()
    engine, *_ = hybrid_ray.initialize(model, config=cfg("fp32"))
    assert model.custom.module.weight.dtype == FP16 and model.body.weight.dtype == FP32
    seen: Dict[str, object] = {}
    record(model.custom.module, seen, "inner")
    record(model.body, seen, "body")
    out = train_step(engine, torch.randn(4, 16))
    assert out.dtype == FP16  # what the subclass forces; an fp32 run does not recast outputs
    assert seen["inner.autocast"] is True and seen["inner.autocast_dtype"] == FP16
    assert seen["body.autocast"] is False and seen["body.out"] == FP32
    assert_params_are_rounded_masters(engine)


def test_fp16_module_subclass_in_an_fp16_run() -> None:
    torch.manual_seed(0)
    model = WithCustom()
    engine, *_ = hybrid_ray.initialize(model, config=cfg("fp16"))
    assert all(p.dtype == FP16 for p in model.parameters())
    out = train_step(engine, torch.randn(4, 16))
    assert out.dtype == FP32  # fp32_outputs: the engine casts the forced fp16 output back
    assert engine.loss_scale == 65536.0


# ---- bf16: norms in fp32, patterns, outputs ------------------------------------------------

class NormNet(nn.Module):
    NORMS = ("ln", "bn", "gn", "rms")

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)
        self.gn = nn.GroupNorm(4, 16)
        self.rms = nn.RMSNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for name in self.NORMS:
            h = getattr(self, name)(h)
        return self.head(h)


def norm_net_engine(**precision: object):
    torch.manual_seed(0)
    model = NormNet()
    engine, *_ = hybrid_ray.initialize(model, config=cfg("bf16", **precision))
    seen: Dict[str, object] = {}
    for name, child in model.named_children():
        record(child, seen, name)
    return model, engine, seen


def test_bf16_keeps_norms_in_fp32() -> None:
    model, engine, seen = norm_net_engine()
    for name in ("fc", "head"):
        assert all(p.dtype == BF16 for p in getattr(model, name).parameters()), name
    for name in NormNet.NORMS:
        assert all(p.dtype == FP32 for p in getattr(model, name).parameters()), name
    assert model.bn.running_mean.dtype == FP32 and model.bn.running_var.dtype == FP32
    stats_before = model.bn.running_mean.clone()
    out = train_step(engine, torch.randn(4, 8))
    assert seen["fc.autocast"] is True and seen["fc.out"] == BF16
    for name in NormNet.NORMS:  # the norm's forward gets fp32 input, autocast off, fp32 out
        assert (seen[name + ".in"], seen[name + ".autocast"], seen[name + ".out"]) == \
            (FP32, False, FP32), name
    assert seen["head.autocast"] is True and seen["head.out"] == BF16
    assert out.dtype == FP32  # fp32_outputs
    assert not torch.equal(model.bn.running_mean, stats_before)  # statistics are kept, in fp32
    assert_params_are_rounded_masters(engine)


def test_hook_registered_first_sees_the_raw_input() -> None:
    model, engine, seen = norm_net_engine()
    raw: List[torch.dtype] = []
    model.ln.register_forward_pre_hook(lambda _m, args: raw.append(args[0].dtype), prepend=True)
    engine(torch.randn(4, 8))
    assert raw == [BF16] and seen["ln.in"] == FP32  # the precision hook cast it in between


def test_norms_fp32_false_keeps_norms_in_bf16() -> None:
    model, engine, seen = norm_net_engine(norms_fp32=False)
    assert all(p.dtype == BF16 for p in model.parameters())
    # BatchNorm's running statistics follow its parameters: batch_norm needs one dtype.
    assert model.bn.running_mean.dtype == BF16 and model.bn.running_var.dtype == BF16
    train_step(engine, torch.randn(4, 8))
    for name in NormNet.NORMS:
        assert (seen[name + ".in"], seen[name + ".autocast"], seen[name + ".out"]) == \
            (BF16, True, BF16), name
    assert_params_are_rounded_masters(engine)


def test_module_pattern_keeps_the_head_in_fp32() -> None:
    model, engine, seen = norm_net_engine(modules={"head": "fp32"})
    assert all(p.dtype == FP32 for p in model.head.parameters())
    assert all(p.dtype == BF16 for p in model.fc.parameters())
    train_step(engine, torch.randn(4, 8))
    assert (seen["head.in"], seen["head.autocast"], seen["head.out"]) == (FP32, False, FP32)
    assert seen["fc.out"] == BF16


def test_module_patterns_are_full_match_regexes_and_children_inherit() -> None:
    torch.manual_seed(0)
    model = GPT(GPT_SIZES["tiny"])
    patterns = {r"blocks\.1": "fp32", r".*\.fc": "fp16", "wp": "fp32"}
    hybrid_ray.initialize(model, config=cfg("bf16", modules=patterns))
    # Children of blocks.1 inherit fp32, except where their own name matches a pattern.
    assert all(p.dtype == FP32 for n, p in model.blocks[1].named_parameters() if not n.startswith("fc."))
    assert model.blocks[1].fc.weight.dtype == FP16 and model.blocks[0].fc.weight.dtype == FP16
    assert model.blocks[0].proj.weight.dtype == BF16 and model.blocks[0].ln1.weight.dtype == FP32
    assert model.wpe.weight.dtype == BF16  # "wp" is a prefix of "wpe", not a full match


def test_tied_weight_shared_with_an_fp32_module_stays_exact_fp32() -> None:
    # GPT ties the embedding to the head: with the head in fp32 the shared weight must be fp32
    # and keep its initial values exactly (not a bf16 round trip).
    torch.manual_seed(0)
    model = GPT(GPT_SIZES["tiny"])
    initial = model.wte.weight.detach().clone()
    engine, *_ = hybrid_ray.initialize(model, config=cfg("bf16", modules={"head": "fp32"}))
    assert model.head.weight is model.wte.weight
    assert model.wte.weight.dtype == FP32 and torch.equal(model.wte.weight.detach(), initial)
    x = torch.randint(0, 64, (2, 16))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied()


def test_tied_weight_works_whichever_module_comes_first() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 8, bias=False)  # the fp32 module is registered first
            self.body = nn.Linear(8, 8, bias=False)
            self.body.weight = self.head.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    torch.manual_seed(0)
    model = Tied()
    engine, *_ = hybrid_ray.initialize(model, config=cfg("bf16", modules={"head": "fp32"}))
    assert model.head.weight.dtype == FP32
    assert train_step(engine, torch.randn(4, 8)).dtype == FP32


def test_fp32_outputs_false_returns_the_compute_dtype() -> None:
    model, engine, _ = norm_net_engine(fp32_outputs=False)
    assert engine(torch.randn(4, 8)).dtype == BF16


# ---- fp32 masters under bf16 ---------------------------------------------------------------

def test_bf16_masters_follow_an_fp32_adamw_reference() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(BF16)  # the same bf16 weights the engine starts from
    lr = 1e-4  # small: many updates are below a bf16 ulp, so only fp32 masters keep them
    engine, *_ = hybrid_ray.initialize(model, config={
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1}}})
    ref_masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(ref_masters, lr=lr, weight_decay=0.1)
    masters = masters_by_param(engine)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        with torch.autocast("cpu", dtype=BF16):
            out = ref(x)
        ref.zero_grad()
        F.mse_loss(out.float(), y).backward()
        for m, p in zip(ref_masters, ref.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(ref_masters, ref.parameters()):
                p.copy_(m)
        for (name, p), m in zip(model.named_parameters(), ref_masters):
            assert torch.allclose(masters[id(p)], m.detach(), rtol=0, atol=1e-6), (step, name)
            assert torch.equal(p.detach(), masters[id(p)].to(BF16)), (step, name)
    # The masters hold what bf16 cannot: some updates left the bf16 weights where they were.
    lost = sum((masters[id(p)] != p.detach().float()).sum().item() for p in model.parameters())
    assert lost > 0


@pytest.mark.parametrize("native", [True, False])
def test_bf16_auto_trains_in_bf16_only_where_the_machine_computes_it_natively(monkeypatch, native) -> None:
    import hybrid_ray.config.sections as sections
    monkeypatch.setattr(sections, "native_bf16", lambda device_type="": native)
    config = hybrid_ray.config.load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": "auto"}})
    assert config.bf16.enabled is native and config.base_dtype == ("bf16" if native else "fp32")
    with pytest.raises(hybrid_ray.config.ConfigError, match=r"bf16\.enabled: invalid value; got 'yes'; allowed: True, False, 'auto'"):
        hybrid_ray.config.load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": "yes"}})


def test_bf16_asked_for_on_a_cpu_that_emulates_it_says_so_once(monkeypatch, caplog) -> None:
    import hybrid_ray.engine.precision as precision
    monkeypatch.setattr(precision, "native_bf16", lambda device_type="": False)
    precision._say_if_bf16_is_emulated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
        for _ in range(2):
            hybrid_ray.initialize(GPT(GPT_SIZES["tiny"]), config=cfg("bf16"))
    said = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(said) == 1 and 'bf16.enabled: "auto"' in said[0], said
    precision._say_if_bf16_is_emulated.cache_clear()
