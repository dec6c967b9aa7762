"""The 1-bit codec and its two-level error-feedback average (compression/onebit.py)."""
from __future__ import annotations

import pytest
import torch

from hybrid_ray.config import load_config
from hybrid_ray.config.errors import ConfigError, NotSupportedError
from hybrid_ray.engine.zero.frozen import check_freezable, step_frozen_variance
from hybrid_ray.engine.compression.onebit import (SignAverage, compress, decompress, pack_signs,
                                                  payload_bytes, unpack_signs)


def test_signs_round_trip_through_their_bytes():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    x[5] = 0.0  # zero is sent as +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 126 == payload_bytes(1001) - 4
    signs = unpack_signs(packed, 1001)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))


def test_the_scale_keeps_the_norm():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    scale, bits = compress(x)
    sent = decompress(scale, bits, x.numel())
    assert torch.allclose(sent.norm(), x.norm(), rtol=1e-5)


def test_error_feedback_loses_nothing_over_time():
    """Averaging the same W tensors over many steps: the decoded averages' running mean
    converges to the true average (the residuals carry what each step did not send)."""
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(777, generator=g) for _ in range(3)]
    truth = torch.stack(tensors).mean(0)
    avg = SignAverage(3)
    steps = 400
    total = sum(avg.average("b", tensors) for _ in range(steps))
    single = (SignAverage(3).average("b", tensors) - truth).norm() / truth.norm()
    avg_error = (total / steps - truth).norm() / truth.norm()
    assert single > 0.3  # one step alone is a crude sign sketch
    assert avg_error < 0.05  # error feedback: nothing is lost, only delayed


def test_the_zero_form_loses_nothing_over_time_either():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(501, generator=g) for _ in range(2)]
    truth = torch.stack(tensors).mean(0)
    avg = SignAverage(2)
    steps = 400
    mean = sum(avg.reduce("b", tensors) for _ in range(steps)) / steps
    assert (mean - truth).norm() / truth.norm() < 0.05


@pytest.mark.parametrize("kind, wd", [("AdamW", 0.1), ("Adam", 0.1), ("AdamW", 0.0)])
def test_frozen_step_is_torchs_step_when_the_variance_would_not_move(kind, wd):
    """Where g*g equals the variance, torch's own step leaves exp_avg_sq unchanged: there the
    frozen step and torch's must agree (moments, step count, bias corrections, weight decay)."""
    g = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(50, generator=g)), torch.nn.Parameter(torch.randn(7, 3, generator=g))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [getattr(torch.optim, kind)(ps, lr=0.01, weight_decay=wd, foreach=False) for ps in (params, twins)]
    for _ in range(3):  # a warm-up with ordinary steps
        for opt, ps in zip(opts, (params, twins)):
            for p, seed in zip(ps, (1, 2)):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            opt.step()
    for p, t in zip(params, twins):
        v = opts[0].state[p]["exp_avg_sq"]
        grad = v.sqrt() * torch.sign(torch.randn(v.shape, generator=g))
        if kind == "Adam":  # L2 decay: torch's variance sees g + wd * p
            grad = grad - wd * p.detach()
        p.grad, t.grad = grad.clone(), grad.clone()
    opts[0].step()
    step_frozen_variance(opts[1])
    for p, t in zip(params, twins):
        torch.testing.assert_close(t, p, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opts[1].state[t][key], opts[0].state[p][key], rtol=1e-6, atol=1e-8)


def test_frozen_step_never_writes_the_variance():
    p = torch.nn.Parameter(torch.ones(10))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full((10,), 0.5)
    opt.step()
    before = opt.state[p]["exp_avg_sq"].clone()
    p.grad = torch.full((10,), 100.0)
    step_frozen_variance(opt)
    assert torch.equal(opt.state[p]["exp_avg_sq"], before) and float(opt.state[p]["step"]) == 2


def test_frozen_step_needs_a_warm_up_and_an_adam():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="warmup_steps >= 1"):
        step_frozen_variance(torch.optim.Adam([p]))
    with pytest.raises(NotSupportedError, match="needs an Adam or AdamW optimizer"):
        check_freezable(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(NotSupportedError, match="amsgrad"):
        check_freezable(torch.optim.Adam([p], amsgrad=True))


@pytest.mark.parametrize("cfg, match", [
    ({"gradient_compression": {"type": "onebit"}}, r"gradient_compression\.warmup_steps.*warm-up"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
     r"gradient_compression\.type, optimizer\.type.*'onebit' with SGD"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5},
      "optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, r"amsgrad"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5, "form": "momentum"},
      "zero_optimization": {"stage": 3}}, r"gradient_compression\.form: .*ZeRO stage 3.*use form 'gradient'"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5, "form": "momentum"},
      "optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}}}, r"gradient_compression\.form: .*weight_decay"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5, "form": "momentum"},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "delayed_param_update": True}}},
     r"gradient_compression\.form: .*delayed_param_update"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5, "form": "moment"}}, r"gradient_compression\.form"),
])
def test_config_refuses_what_onebit_cannot_do(cfg, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"train_micro_batch_size_per_gpu": 1, **cfg})


@pytest.mark.parametrize("extra, kind", [
    ({"zero_optimization": {"stage": 0}}, "OneBitMomentum"), ({"zero_optimization": {"stage": 1}}, "OneBitMomentum"),
    ({"zero_optimization": {"stage": 2}}, "OneBitMomentum"), ({"zero_optimization": {"stage": 3}}, "OneBit"),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}}}, "OneBit"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "delayed_param_update": True}}}, "OneBit"),
    ({"pipeline_model_parallel_size": 2}, "OneBit"),
    ({"gradient_compression": {"type": "onebit", "warmup_steps": 5, "form": "gradient"}}, "OneBit")])
def test_auto_form_is_the_momentum_form_where_it_can_run(extra, kind):
    from hybrid_ray.engine.compression import reduction_setup
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                       "gradient_compression": {"type": "onebit", "warmup_steps": 5}, **extra})
    assert type(reduction_setup(cfg).compressor).__name__ == kind


def test_the_momentum_form_refuses_a_client_adam_with_l2_decay():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(NotSupportedError, match=r"form 'momentum'.*weight_decay.*AdamW"):
        check_freezable(torch.optim.Adam(model.parameters(), weight_decay=0.1), momentum=True)
    check_freezable(torch.optim.AdamW(model.parameters(), weight_decay=0.1), momentum=True)
    check_freezable(torch.optim.Adam(model.parameters(), weight_decay=0.1))  # the gradient form takes it


def test_deepspeeds_onebitadam_is_adamw_with_onebit_compression():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400,
                                                                      "cuda_aware": False, "comm_backend_name": "nccl",
                                                                      "weight_decay": 0.01}}})
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {"lr": 1e-3, "weight_decay": 0.01}
    assert cfg.gradient_compression.type == "onebit" and cfg.gradient_compression.warmup_steps == 400
    with pytest.raises(NotSupportedError, match=r"optimizer\.type.*ZeroOneAdam"):
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "ZeroOneAdam"}})
    with pytest.raises(ConfigError, match="OneBitAdam with 'topk'"):
        load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "OneBitAdam"},
                     "gradient_compression": {"type": "topk"}})


def test_switching_a_client_sgd_to_onebit_is_refused_and_changes_nothing():
    import hybrid_ray
    model = torch.nn.Linear(4, 2)
    engine, *_ = hybrid_ray.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config={"train_micro_batch_size_per_gpu": 1})
    before = engine.gradient_compression
    with pytest.raises(NotSupportedError, match="needs an Adam or AdamW optimizer"):
        engine.set_gradient_compression({"type": "onebit", "warmup_steps": 1})
    assert engine.gradient_compression == before and engine.reducer.compressor is None
    engine.close()


def test_an_element_that_never_saw_a_gradient_is_not_moved_by_the_frozen_step():
    """Its variance is 0: a 1-bit +-scale divided by eps would throw it 1e8 x lr away."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.tensor([0.5, 0.0, -0.5, 0.0])  # elements 1 and 3 unused in the warm-up
    opt.step()
    before = p.detach().clone()
    p.grad = torch.tensor([0.3, 0.3, -0.3, -0.3])  # the 1-bit exchange gives every element a value
    step_frozen_variance(opt)
    moved = (p.detach() - before).abs()
    assert moved[1] == 0 and moved[3] == 0 and 0 < moved[0] < 0.2 and 0 < moved[2] < 0.2
    assert opt.state[p]["exp_avg"][1] == 0 and opt.state[p]["exp_avg"][3] == 0


def test_momentum_given_sets_the_momentum_and_steps_with_it():
    """onebit's momentum form: .grad is the averaged momentum; the update is AdamW's with it."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01)
    p.grad = torch.tensor([0.5, -0.2, 0.1])
    opt.step()
    v = opt.state[p]["exp_avg_sq"].clone()
    before = p.detach().clone()
    m = torch.tensor([0.3, 0.1, -0.4])
    p.grad = m.clone()
    step_frozen_variance(opt, momentum_given=True)
    assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
    t = 2
    want = before * (1 - 0.1 * 0.01) - 0.1 * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(p.detach(), want)


def test_block_scales_are_each_blocks_rms_and_one_block_is_encode():
    from hybrid_ray.engine.compression.onebit import encode, encode_blocks, payload_bytes
    x = torch.randn(70, generator=torch.Generator().manual_seed(9))
    got = encode_blocks(x, 32)
    for a, b in [(0, 32), (32, 64), (64, 70)]:  # the last block: its own 6 elements
        part = x[a:b]
        assert torch.allclose(got[a:b], torch.sign(part) * part.norm() / (b - a) ** 0.5)
    assert torch.equal(encode_blocks(x, 0), encode(x)[1]) and torch.equal(encode_blocks(x, 70), encode(x)[1])
    assert payload_bytes(70, 32) == 9 + 3 * 4 and payload_bytes(70) == payload_bytes(70, 100) == 9 + 4


def test_the_update_bound_caps_each_element_at_lr_and_leaves_fitting_variances_alone():
    """update_bound: a variance frozen while an element's gradient was small would turn a later
    large momentum into a step of many times lr; read as at least m_hat^2, it moves lr at most.
    An element whose sqrt(v_hat) already exceeds |m_hat| steps exactly as without the bound."""
    def stepped(bound):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
        p.grad = torch.tensor([1e-4, 1.0])  # element 0 freezes with a tiny variance
        opt.step()
        before = p.detach().clone()
        p.grad = torch.tensor([2.0, 0.1])  # its momentum grows; element 1's fits its variance
        step_frozen_variance(opt, momentum_given=True, bound=bound)
        return (p.detach() - before).abs()
    free, bounded = stepped(False), stepped(True)
    assert free[0] > 100 * 0.1  # the published update: thousands of lr
    torch.testing.assert_close(bounded[0], torch.tensor(0.1))  # |m_hat| / |m_hat| * lr
    assert torch.equal(bounded[1], free[1]) and 0 < bounded[1] < 0.1


def test_onebit_takes_the_update_bound_from_the_config():
    from hybrid_ray.engine.compression import build_compressor
    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    for given, want in [({}, True), ({"update_bound": False}, False)]:
        gc = {"type": "onebit", "warmup_steps": 5, **given}
        cfg = load_config({**base, "gradient_compression": gc})
        assert build_compressor(cfg.gradient_compression).update_bound is want
