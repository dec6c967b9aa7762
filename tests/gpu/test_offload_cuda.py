"""Optimizer offload on a CUDA device: the real device<->host path (pinned buffers, side-stream
copies, host-side casts, the delayed update's thread), parity with torch, fp16 overflow, memory.

Skipped where no GPU is present (CI); run on a GPU machine with `pytest tests/gpu`. The
two-GPU test (NCCL, 2 processes) also needs a second GPU.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
import torch.distributed as dist

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.models import GPT, GPT_SIZES
from tests.distributed import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = dataclasses.replace(GPT_SIZES["small"], bias=False)
MICRO, STEPS, LR, WD = 4, 5, 1e-3, 0.1


def config(stage: int, gas: int = 1, delayed: bool = False, precision: str = "fp32",
           clip: float = 1.0) -> dict:
    offload = {"device": "cpu", "pin_memory": True, "delayed_param_update": delayed}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200_000, "offload_optimizer": offload},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(step: int, k: int, rank: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * k + rank)  # CPU: same on every process
    x = torch.randint(0, CFG.vocab_size, (MICRO, CFG.seq_len + 1), generator=g).to(device)
    return x[:, :-1], x[:, 1:]


def reference(world: int, gas: int, delayed: bool, device: torch.device,
              clip: float = 1.0) -> Dict[str, torch.Tensor]:
    """Fused AdamW on the whole batch; `delayed`: the one-step-stale rule of offload.py."""
    torch.manual_seed(0)
    master = GPT(CFG).to(device)
    model = copy.deepcopy(master)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD, fused=True)
    for step in range(STEPS):
        model.zero_grad()
        for k in range(gas):
            for r in range(world):
                (model(*batch(step, k, r, device)) / (gas * world)).backward()
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        if delayed:
            model.load_state_dict(master.state_dict())
        torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        if not delayed:
            model.load_state_dict(master.state_dict())
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def train(cfg: dict, rank: int, world: int, device: torch.device, topo: Topology) -> Engine:
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), cfg, topology=topo)
    gas = cfg["gradient_accumulation_steps"]
    for step in range(STEPS):
        for k in range(gas):
            engine.backward(engine(*batch(step, k, rank, device)))
            engine.step()
    engine.finish_delayed_update()
    return engine


def max_rel_err(ours: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    return max(((ours[n].float() - ref[n]).norm() / ref[n].norm()).item() for n in ref)


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("stage, gas, delayed", [(1, 1, False), (2, 2, False), (2, 2, True)])
def test_fp32_offload_matches_fused_adamw_on_cuda(stage: int, gas: int, delayed: bool) -> None:
    engine = train(config(stage, gas, delayed), 0, 1, CUDA0, Topology(0, 1, CUDA0))
    assert all(m.device.type == "cpu" and m.is_pinned() for m in engine.zero.masters)
    ours = {n: p.detach() for n, p in engine.module.named_parameters()}
    err = max_rel_err(ours, reference(1, gas, delayed, CUDA0))
    assert err < 1e-5, err


@pytest.mark.parametrize("stage, ratio", [(2, 0.5), (3, 0.5), (2, "auto")])
def test_partial_offload_matches_fused_adamw_on_cuda(stage: int, ratio: object) -> None:
    # Part of the masters on the host, part on the device, one fused optimizer over both.
    cfg = config(stage)
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    engine = train(cfg, 0, 1, CUDA0, Topology(0, 1, CUDA0))
    if ratio != "auto":  # auto: a model this small fits whole in half of an idle GPU
        assert {m.device.type for m in engine.zero.masters} == {"cpu", "cuda"}
        mem = engine.memory_breakdown()
        assert mem["host_master_params"] > 0 and mem["master_params"] > 0, mem
    else:
        assert all(m.device.type == "cuda" for m in engine.zero.masters)
    ours = {n: p.detach() for n, p in engine.module.named_parameters()}
    err = max_rel_err(ours, reference(1, 1, False, CUDA0))
    assert err < 1e-5, err


def _bf16_offload_engine() -> Engine:
    cfg = config(2, precision="bf16")
    cfg["precision"] = {"norms_fp32": False}  # every parameter bf16: bytes per parameter exact
    torch.manual_seed(0)
    return Engine(GPT(CFG), cfg, topology=Topology(0, 1, CUDA0))


def test_bf16_offload_keeps_only_half_params_on_the_device() -> None:
    engine = _bf16_offload_engine()
    x, y = batch(0, 0, 0, CUDA0)
    losses = []
    for _ in range(20):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    state = engine.optimizer.state[engine.zero.masters[0]]
    assert state["exp_avg"].device.type == "cpu"
    n = sum(p.numel() for p in engine.module.parameters())
    per = {k: v / n for k, v in engine.memory_breakdown().items()}
    assert per["params"] == pytest.approx(2, rel=0.02) and per["grads"] == pytest.approx(2, rel=0.02)
    assert per["master_params"] == per["optimizer_state"] == 0
    assert per["host_master_params"] == pytest.approx(4, rel=0.02)
    assert per["host_optimizer_state"] == pytest.approx(8, rel=0.02)


@pytest.mark.parametrize("delayed", [False, True])
def test_fp16_overflow_is_skipped_with_offload_on_cuda(delayed: bool) -> None:
    torch.manual_seed(0)
    e = Engine(GPT(CFG), config(2, delayed=delayed, precision="fp16"), topology=Topology(0, 1, CUDA0))
    before = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    e.backward(e(*batch(0, 0, 0, CUDA0)) * float("inf"))
    e.step()
    assert not e.was_step_applied() and e.skipped_steps == 1 and e.loss_scale == 128
    e.finish_delayed_update()
    assert all(torch.equal(before[n], p) for n, p in e.module.named_parameters())
    first = None
    for step in range(30):
        loss = e(*batch(step % 2, 0, 0, CUDA0))
        first = first if first is not None else loss.item()
        e.backward(loss)
        e.step()
    assert e.skipped_steps == 1 and loss.item() < first


@pytest.mark.parametrize("precision, gas, ratio", [("bf16", 2, 1.0), ("fp32", 1, 1.0), ("bf16", 1, 0.5)])
def test_overlap_step_is_the_same_update_on_cuda(precision: str, gas: int, ratio: float) -> None:
    """offload_optimizer.overlap_step: the host buckets stepped in a thread during backward, as
    their side-stream copies land, give the plain step's parameters and Adam state bitwise."""
    topo = Topology(0, 1, CUDA0)
    engines = []
    for overlap in (False, True):
        cfg = config(2, gas, precision=precision, clip=0.0)
        cfg["zero_optimization"]["offload_optimizer"].update(overlap_step=overlap, ratio=ratio)
        engines.append(train(cfg, 0, 1, CUDA0, topo))
    plain, over = engines
    assert over.zero.backward_step.overlapped == STEPS - 1
    assert all(torch.equal(p, q) for p, q in zip(plain.module.parameters(), over.module.parameters()))
    sp, so = plain.optimizer.state_dict()["state"], over.optimizer.state_dict()["state"]
    assert all(torch.equal(sp[i][k], so[i][k]) for i in sp for k in sp[i])


def test_overlap_step_rolls_back_an_overflow_on_cuda() -> None:
    cfg = config(2, precision="fp16", clip=0.0)
    cfg["zero_optimization"]["offload_optimizer"]["overlap_step"] = True
    torch.manual_seed(0)
    e = Engine(GPT(CFG), cfg, topology=Topology(0, 1, CUDA0))
    for step in range(2):  # the first step creates the state; the second overlaps
        e.backward(e(*batch(step, 0, 0, CUDA0)))
        e.step()
    masters = [m.detach().clone() for m in e.zero.masters]
    before = [p.detach().clone() for p in e.module.parameters()]
    first = e.module.wte.weight
    first.register_hook(lambda g: g * float("inf"))  # the last gradient of backward
    e.backward(e(*batch(2, 0, 0, CUDA0)))
    e.step()
    assert not e.was_step_applied() and e.zero.backward_step.rolled_back > 0
    for m, old in zip(e.zero.masters, masters):
        assert (m.detach() - old).norm() <= 1e-6 * old.norm()
    # Buckets uploaded during backward are written back: the parameters are the old ones.
    for p, old in zip(e.module.parameters(), before):
        assert (p.detach().float() - old.float()).norm() <= 1e-3 * old.float().norm()


# ---- two GPUs, NCCL ---------------------------------------------------------------------
def _worker(rank: int, world: int, out: str) -> None:
    device = torch.device("cuda", rank)
    topo = Topology(rank, world, device, dist.group.WORLD)
    for stage, gas, delayed in ((2, 2, False), (2, 2, True), (1, 1, False)):
        engine = train(config(stage, gas, delayed), rank, world, device, topo)
        state = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
        torch.save(state, Path(out) / f"s{stage}-{gas}-{delayed}-r{rank}.pt")
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_offload_matches_fused_adamw(tmp_path: Path) -> None:
    spawn.run(_worker, 2, str(tmp_path), backend="nccl")
    for stage, gas, delayed in ((2, 2, False), (2, 2, True), (1, 1, False)):
        ref = {n: t.cpu() for n, t in reference(2, gas, delayed, CUDA0).items()}
        ranks = [torch.load(tmp_path / f"s{stage}-{gas}-{delayed}-r{r}.pt") for r in range(2)]
        assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ref), (stage, delayed)
        err = max_rel_err(ranks[0], ref)
        assert err < 1e-5, (stage, gas, delayed, err)


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_persistent_host_buffers_are_page_locked_at_their_exact_size(delayed: bool) -> None:
    """Masters, master gradients and the delayed update's staging are registered host memory of
    exactly their size (torch's caching host allocator would round each up to a power of two),
    copies from them stay asynchronous, and close() unregisters them."""
    torch.manual_seed(0)
    topo = Topology(0, 1, torch.device("cuda", 0))
    engine = Engine(GPT(CFG), config(2, delayed=delayed, precision="bf16"), topology=topo)
    for step in range(3):
        engine.backward(engine(*batch(step, 0, 0, topo.device)))
        engine.step()
    engine.finish_delayed_update()
    offload = engine.zero.offload
    masters = engine.zero.masters
    assert all(m.is_pinned() for m in masters)
    assert all(g.is_pinned() for s in offload._grad_sets for g in s.values())
    exact = sum(m.numel() * 4 for m in masters) + offload.grad_bytes()
    if delayed:  # + a bf16 staging copy of each master whose parameters are bf16 (not the norms')
        exact += sum(m.numel() * 2 for s, m in zip(engine.spaces, masters) if s.dtype == torch.bfloat16)
    assert offload.pinned_bytes() == exact
    assert engine.memory_breakdown()["host_pinned"] == exact
    engine.close()
    assert offload.pinned_bytes() == 0 and not masters[0].is_pinned()


def _init_growth(offload: bool) -> Tuple[int, int, Engine]:
    torch.manual_seed(0)
    model = GPT(CFG).to(CUDA0, torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    cfg = config(2, precision="bf16")
    if not offload:
        del cfg["zero_optimization"]["offload_optimizer"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine = Engine(model, cfg, topology=Topology(0, 1, CUDA0))
    return torch.cuda.max_memory_allocated() - before, numel, engine


def test_offloaded_masters_are_made_on_the_host_without_a_device_fp32_copy() -> None:
    """A bf16 model's fp32 masters go straight to the host: building the engine never holds a
    whole fp32 copy of the shard on the device (a 10B model's was 32 GB there), so its peak is
    the plain engine's less the masters' 4 bytes per element."""
    plain, numel, engine = _init_growth(offload=False)
    engine.close()
    del engine
    offloaded, _, engine = _init_growth(offload=True)
    assert all(m.device.type == "cpu" for m in engine.zero.masters)
    assert offloaded <= plain - 3 * numel, (offloaded, plain, numel)
    engine.close()


def test_a_precision_switch_with_offload_keeps_the_fp32_state_off_the_device() -> None:
    # A switch re-lays the state out: the old layout's device buffers go before the new one is
    # built, and the offloaded fp32 masters and moments never come to the device for it.
    engine = _bf16_offload_engine()
    x, y = batch(0, 0, 0, CUDA0)
    engine.backward(engine(x, y))
    engine.step()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine._switch_precision("fp16")
    torch.cuda.synchronize()
    n = sum(p.numel() for p in engine.module.parameters())
    above = (torch.cuda.max_memory_allocated() - start) / n
    print(f"device peak above the switch's start: {above:.2f} bytes per element")
    assert above <= 2.5, above
    assert engine.module.blocks[0].fc.weight.dtype == torch.float16
    assert engine.optimizer.state[engine.zero.masters[0]]["exp_avg"].device.type == "cpu"
    engine.backward(engine(x, y))
    engine.step()
    engine.destroy()
