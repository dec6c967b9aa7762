"""The engine under DeepSpeed's names: initialize(args=...), getters, accumulation boundaries,
no_sync, save_16bit_model, the steps_per_print line and the no-effect warning."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hybrid_ray as deepspeed
from hybrid_ray.config import ConfigError, NotSupportedError

CFG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def args_for(path=None, local_rank=None) -> argparse.Namespace:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    argv = (["--deepspeed", "--deepspeed_config", str(path)] if path else [])
    return parser.parse_args(argv + ([f"--local_rank={local_rank}"] if local_rank is not None else []))


def test_initialize_reads_args_deepspeed_config(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CFG))
    net = model()
    engine, opt, _, _ = deepspeed.initialize(args=args_for(path), model=net,
                                             model_parameters=net.parameters())
    assert engine.train_batch_size() == 4 and opt is engine.optimizer
    deepspeed.initialize(args=args_for(path), model=model(), config=dict(CFG))  # the same config
    with pytest.raises(ConfigError, match=r"config, args.deepspeed_config: contradiction"):
        deepspeed.initialize(args=args_for(path), model=model(), config={**CFG, "train_batch_size": 8})
    with pytest.raises(ConfigError, match=r"config: missing.*--deepspeed_config"):
        deepspeed.initialize(args=args_for(), model=model())
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"args.local_rank: contradiction; got 0 but LOCAL_RANK is 1"):
        deepspeed.initialize(args=args_for(path, local_rank=0), model=model())


def test_getters() -> None:
    engine, *_ = deepspeed.initialize(model=model(), config={**CFG, "fp16": {"enabled": True},
                                                             "zero_optimization": {"stage": 1}})
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and isinstance(engine, deepspeed.Engine)
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.local_rank) == (0, 1, 1, 0)
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.zero_optimization_stage() == 1 and engine.get_data_parallel_group() is None
    assert engine.get_loss_scale() == 2.0 ** 16 and engine.get_lr() == [0.01]
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.gradient_accumulation_steps() == 1
    assert engine.device == torch.device("cpu") and isinstance(engine.module, nn.Module)
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()


def train(engine, batches, style: str) -> None:
    """Four micro-batches into one optimizer step, the way `style` says."""
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if style == "boundary":
            engine.set_gradient_accumulation_boundary(last)
        ctx = engine.no_sync() if style == "no_sync" and not last else _null()
        with ctx:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
        if style == "counted":
            engine.step()
    if style != "counted":
        engine.step()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


@pytest.mark.parametrize("style, gas", [("boundary", 4), ("no_sync", 1)])
def test_manual_boundaries_equal_counted_accumulation(style: str, gas: int) -> None:
    torch.manual_seed(1)
    batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(4)]
    ref, *_ = deepspeed.initialize(model=model(), config={**CFG, "train_batch_size": 16,
                                                          "train_micro_batch_size_per_gpu": 4})
    train(ref, batches, "counted")
    got, *_ = deepspeed.initialize(model=model(), config={**CFG, "train_batch_size": 4 * gas,
                                                          "train_micro_batch_size_per_gpu": 4})
    train(got, batches, style)
    assert got.global_steps == 1 and got.was_step_applied()
    scale = 1.0 if style == "boundary" else 4.0  # no_sync with gas 1 sums the losses: lr sees 4x grads
    for a, b in zip(ref.module.parameters(), got.module.parameters()):
        if scale == 1.0:
            assert torch.allclose(a, b, atol=1e-6)
    if scale != 1.0:  # AdamW is scale-invariant up to eps: the same update
        for a, b in zip(ref.module.parameters(), got.module.parameters()):
            assert torch.allclose(a, b, atol=1e-5)


def test_step_inside_no_sync_is_refused() -> None:
    engine, *_ = deepspeed.initialize(model=model(), config=CFG)
    with engine.no_sync(), pytest.raises(RuntimeError, match="inside no_sync"):
        engine.step()


def test_save_16bit_model(tmp_path: Path) -> None:
    engine, *_ = deepspeed.initialize(model=model(), config={**CFG, "bf16": {"enabled": True}})
    assert engine.save_16bit_model(str(tmp_path / "out"))
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert set(state) == set(model().state_dict()) and state["0.weight"].dtype == torch.bfloat16
    assert engine.save_fp16_model(str(tmp_path), "m.pt") and (tmp_path / "m.pt").exists()
    with pytest.raises(NotSupportedError, match="save_latest=False"):
        engine.save_checkpoint(str(tmp_path / "c"), save_latest=False)


def test_steps_per_print_line_and_opt_out(capsys) -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    for print_steps in (True, False):
        engine, *_ = deepspeed.initialize(model=model(), config={**CFG, "steps_per_print": 2},
                                          print_steps=print_steps)
        for _ in range(4):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[Rank 0] step=")]
        if print_steps:
            assert [ln.split(",")[0] for ln in lines] == ["[Rank 0] step=2", "[Rank 0] step=4"]
            assert "skipped=0, lr=[0.01]" in lines[0] and "loss_scale=1" in lines[0]
        else:
            assert lines == []


def test_no_effect_settings_warn_visibly() -> None:
    with pytest.warns(UserWarning, match=r"no effect here: .*prescale_gradients=True"):
        deepspeed.initialize(model=model(), config={**CFG, "prescale_gradients": True})


def test_optimizer_and_scheduler_callables() -> None:
    engine, opt, _, sched = deepspeed.initialize(
        model=model(), config={"train_batch_size": 4},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert isinstance(opt, torch.optim.SGD) and sched.optimizer is opt
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert engine.get_lr() == [0.25]


def test_mpu_with_model_parallelism_is_refused() -> None:
    mpu = type("MPU", (), {"get_model_parallel_world_size": staticmethod(lambda: 2)})()
    with pytest.raises(NotSupportedError, match="mpu"):
        deepspeed.initialize(model=model(), config=CFG, mpu=mpu)
    os.environ.pop("LOCAL_RANK", None)


def test_destroy_releases_the_engine() -> None:
    import hybrid_ray as deepspeed

    net = nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    loss = engine(torch.randn(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    w = net.weight.detach().clone()
    engine.destroy()
    assert torch.equal(net.weight.detach(), w)


def test_step_after_a_direct_loss_backward_is_refused() -> None:
    net = nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    engine(torch.randn(2, 4)).sum().backward()  # PyTorch-style: bypasses the engine
    with pytest.raises(NotSupportedError, match="direct loss.backward"):
        engine.step()


def test_compile_compiles_the_module_once() -> None:
    net = nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert not engine.is_compiled
    engine.compile(backend="eager")
    engine.compile(backend="eager")  # a second call is a no-op, as in DeepSpeed
    assert engine.is_compiled and net._compiled_call_impl is not None
    w = net.weight.detach().clone()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    assert not torch.equal(net.weight.detach(), w)
    with pytest.raises(NotSupportedError, match="DeepCompile"):
        engine.compile(schedule=[])
    assert deepspeed.accelerator.get_accelerator().get_compile_backend() == "inductor"
