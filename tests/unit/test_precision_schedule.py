"""precision.schedule changes the compute dtype at a step boundary and loses nothing (seed 7.3)."""
from __future__ import annotations

import torch

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT, GPT_SIZES

CPU = Topology(0, 1, torch.device("cpu"))


def make_engine(schedule: list, stage: int = 1) -> Engine:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
           "precision": {"schedule": schedule}}
    return Engine(GPT(GPT_SIZES["tiny"]), cfg, topology=CPU)


def train_step(engine: Engine, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (2, 17), generator=g)
    loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    engine.step()
    return loss.item()


def snapshot(engine: Engine) -> dict:
    """Per-parameter fp32 masters and Adam moments, by name."""
    from hybrid_ray.engine.zero import relayout
    state = relayout.export_state(engine.spaces, engine.zero.masters, engine.optimizer, engine.topology)
    return {n: state[id(p)] for n, p in engine.module.named_parameters()}


def test_switch_keeps_masters_and_optimizer_state_and_changes_dtypes() -> None:
    engine = make_engine([{"step": 2, "dtype": "bf16"}])
    assert engine.module.head.weight.dtype == torch.float32
    train_step(engine, 0)
    train_step(engine, 1)  # the switch happens at the end of this step's boundary
    assert engine.base_dtype == "bf16"
    linear = engine.module.blocks[0].fc.weight
    norm = engine.module.blocks[0].ln1.weight
    assert linear.dtype == torch.bfloat16 and norm.dtype == torch.float32
    after = snapshot(engine)
    # A twin that never switched holds the same fp32 state after the same two steps.
    twin = make_engine([])
    train_step(twin, 0)
    train_step(twin, 1)
    before = snapshot(twin)
    for name, tensors in before.items():
        for key, t in tensors.items():
            assert torch.equal(after[name][key], t), (name, key)
    assert torch.equal(linear, after["blocks.0.fc.weight"]["master"].to(torch.bfloat16))
    step_before = twin.optimizer.state[twin.zero.masters[0]]["step"]
    assert all(torch.equal(engine.optimizer.state[m]["step"], step_before) for m in engine.zero.masters)


def test_training_goes_on_after_switches_both_ways() -> None:
    engine = make_engine([{"step": 2, "dtype": "bf16"}, {"step": 4, "dtype": "fp32"}], stage=2)
    losses = [train_step(engine, s % 2) for s in range(8)]
    assert engine.base_dtype == "fp32" and engine.module.blocks[0].fc.weight.dtype == torch.float32
    assert engine.skipped_steps == 0 and engine.global_steps == 8
    assert losses[-1] < losses[0]


def test_a_switch_lets_go_of_the_old_layouts_buffers() -> None:
    # Built beside the old layout, the new one would double the device memory a switch needs:
    # the old flat parameters, gradients (stage 1: .grad views of them), masters and moments
    # must be unreachable once the switch is done.
    import gc
    import weakref

    engine = make_engine([{"step": 2, "dtype": "bf16"}], stage=1)
    train_step(engine, 0)  # the moments exist from here on
    master = engine.zero.masters[0]
    old = [engine.spaces[0].flat, engine.reducer.grads[0].flat_grad, master,
           *(v for v in engine.optimizer.state[master].values() if torch.is_tensor(v) and v.dim())]
    assert len(old) == 5  # flat, gradient, master, two moments
    old = [weakref.ref(t) for t in old]
    del master
    train_step(engine, 1)  # the switch follows this step
    assert engine.base_dtype == "bf16"
    gc.collect()
    assert [r() is None for r in old] == [True] * 5
    train_step(engine, 2)
