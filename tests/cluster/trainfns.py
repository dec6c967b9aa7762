"""Training functions the cluster tests run on Ray workers (pickled by value, see conftest).

A small MLP trained by the engine in fp32 at ZeRO-2 with a fixed global batch of 12 samples
drawn from the step number alone, so every world size sees the same data per step and a run
resumed from a checkpoint replays exactly what an uninterrupted run does.
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

import hybrid_ray
from hybrid_ray.cluster import StopTraining, WorkerContext

GLOBAL_BATCH, DIM = 12, 16  # 12 splits evenly over 1, 2, 3 and 4 workers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1))


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train_mlp(ctx: WorkerContext, steps: int = 12, every: int = 2, stage: int = 2,
              fault: dict | None = None, step_delay: float = 0.0, hold_at: tuple = ()):
    """Train to `steps`, checkpoint every `every` steps, resume from the newest checkpoint.

    fault: {"generation": g, "rank": r, "step": s, "kind": "exit" | "freeze"} makes that rank
    exit its process or hang forever at step s of generation g (a lost or frozen worker);
    step "final" exits right after the last checkpoint. Each checkpoint is saved after the
    driver has every record reported so far (ctx.flush_reports). hold_at: (step, world size)
    pairs: at that checkpoint step a group of another size waits for the driver to stop it (a
    resize it must see), however slowly the machine brings a node up or notices one gone."""
    world = ctx.world_size
    cfg = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    engine, _, _, _ = hybrid_ray.initialize(_model(), config=cfg, topology=ctx.topology)
    ckpt = os.path.join(ctx.storage_path, ctx.run_name, "checkpoints")
    engine.load_checkpoint(ckpt)
    while engine.global_steps < steps:
        step = engine.global_steps
        _maybe_fault(ctx, step, fault)
        x, y = (t.to(ctx.topology.device) for t in _batch(step, ctx.rank, world))
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ctx.step_done(engine.global_steps)
        if ctx.rank == 0:
            ctx.report({"step": engine.global_steps, "loss": loss.item(), "world_size": world})
        time.sleep(step_delay)
        if engine.global_steps % every == 0:
            ctx.flush_reports()
            engine.save_checkpoint(ckpt)
            if ctx.agree_to_stop():
                raise StopTraining()
            _hold(ctx, engine.global_steps, hold_at)
    _maybe_fault(ctx, "final", fault)
    state = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    engine.close()
    return state


def _hold(ctx: WorkerContext, step: int, hold_at: tuple) -> None:
    for at, world in hold_at:
        while step == at and ctx.world_size != world:
            time.sleep(0.2)
            if ctx.agree_to_stop():  # fails at once if a peer is lost meanwhile
                raise StopTraining()


def _maybe_fault(ctx: WorkerContext, step: int, fault) -> None:
    """fault: one dict or a list of them."""
    for f in fault if isinstance(fault, list) else [fault]:
        if f and f["generation"] == ctx.generation and f["rank"] == ctx.rank and f["step"] == step:
            _fault(f)


def _fault(fault: dict) -> None:
    if fault["kind"] == "exit":
        os._exit(1)
    while True:  # frozen: alive, never steps again, never answers a collective
        time.sleep(3600)


def reference(rank: int, world: int, storage: str, out: str, steps: int) -> None:
    """The same training under the plain process-group harness (torchrun's way), for parity."""
    from hybrid_ray.cluster import local_context
    state = train_mlp(local_context(storage, "reference"), steps=steps)
    if rank == 0:
        torch.save(state, out)


def train_following(ctx: WorkerContext, steps: int = 20, step_delay: float = 0.1):
    """Train at ZeRO-2 and, after every step, agree with the other ranks on the driver's newest
    directive and apply its gradient compression setting. Every rank reports the (step, id) at
    which it applied each directive and a checksum of its parameters."""
    world = ctx.world_size
    cfg = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
           "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, _, _, _ = hybrid_ray.initialize(_model(), config=cfg, topology=ctx.topology)
    applied, current = [], None
    while engine.global_steps < steps:
        x, y = (t.to(ctx.topology.device) for t in _batch(engine.global_steps, ctx.rank, world))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        ctx.step_done(engine.global_steps)
        time.sleep(step_delay)
        directive = ctx.agree_on_directive()
        if directive is not None and directive["id"] != current:
            engine.set_gradient_compression(directive["setting"])
            current = directive["id"]
            applied.append((engine.global_steps, current, engine.gradient_compression["type"]))
    checksum = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
    ctx.report({"rank": ctx.rank, "applied": applied, "checksum": checksum})
    engine.close()
    return applied
