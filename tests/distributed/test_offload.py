"""Optimizer offload (ZeRO-Offload) on 2 and 4 gloo ranks: parity, delayed update, overflow, memory.

The engine's device is the CPU here, so offload still moves masters, master gradients and the
optimizer state into separate host buffers and steps torch's fused CPU optimizer, but every
copy is synchronous and nothing is pinned (tests/gpu/test_offload_cuda.py covers the real
device<->host path). One spawn per world size runs every scenario.

- fp32 stages 1 and 2 with offload equal single-process AdamW on the whole batch, with
  accumulation and clipping (tolerance of test_zero_parity);
- delayed_param_update equals a single-process reference that applies the one-step-stale rule
  explicitly: the gradient of step t is taken on w_{max(t-2,0)} and applied to w_{t-1};
- stage 3 (partitioned parameters) gets offload through the same optimizer and reducer;
- bf16 with offload converges; fp16 overflow on one rank skips the step on every rank (with and
  without the delayed update); the device holds only the half-precision parameters.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
import torch.nn as nn

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.engine.zero import partial, relayout
from hybrid_ray.models import GPT, GPT_SIZES
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, MICRO, LR, WD = 4, 2, 1e-2, 0.1
CFG = dataclasses.replace(GPT_SIZES["tiny"], bias=False)  # why no biases: test_zero_parity.py

# name -> (stage, accumulation, clipping, delayed update, extra zero_optimization keys)
PARITY: Dict[str, Tuple[int, int, float, bool, dict]] = {
    "s1": (1, 1, 0.0, False, {}),
    "s1_acc_clip": (1, 2, 0.05, False, {}),
    "s2_acc_clip": (2, 3, 0.05, False, {}),
    "s2_no_overlap_allreduce": (2, 2, 0.0, False, {"overlap_comm": False, "reduce_scatter": False}),
    "s1_dpu": (1, 1, 0.0, True, {}),
    "s2_dpu_acc_clip": (2, 2, 0.05, True, {}),
    # Stage 3 reuses the optimizer and reducer: offload comes with them (masters copied into the
    # local shard of the partitioned parameters instead of all-gathered).
    "s3_dpu_acc_clip": (3, 2, 0.05, True, {"stage3_param_persistence_threshold": 1000,
                                         "stage3_prefetch_bucket_size": 5000}),
    # Partial offload (offload_optimizer.ratio): part of the masters on the host, part on the
    # "device", one optimizer over both; on the CPU the two placements are distinct buffers.
    "s1_partial": (1, 1, 0.0, False, {"ratio": 0.5}),
    "s2_partial_acc_clip": (2, 2, 0.05, False, {"ratio": 0.3}),
    "s3_partial_acc_clip": (3, 2, 0.05, False, {"ratio": 0.5, "stage3_param_persistence_threshold": 1000,
                                                "stage3_prefetch_bucket_size": 5000}),
}
FOUR_RANKS = ["s2_acc_clip", "s2_dpu_acc_clip"]
OVERFLOW = {"fp16_s2": False, "fp16_s1_dpu": True}  # name -> delayed update
OVERFLOW_STAGE = {"fp16_s2": 2, "fp16_s1_dpu": 1}
OVERFLOW_STEPS, K = 5, 2


def batch(step: int, k: int, rank: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch k of rank `rank` at `step`: a fixed slice of a seeded global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (8 * world * MICRO, CFG.seq_len + 1), generator=g)
    lo = (k * world + rank) * MICRO
    chunk = tokens[lo:lo + MICRO]
    return chunk[:, :-1], chunk[:, 1:]


def config(stage: int, gas: int, clip: float, delayed: bool, extra: dict, precision: str = "fp32") -> dict:
    offload = {"device": "cpu", "pin_memory": True, "delayed_param_update": delayed}
    extra = dict(extra)
    if "ratio" in extra:
        offload["ratio"] = extra.pop("ratio")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "offload_optimizer": offload,
                                 **extra},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    if precision != "fp32":  # fp16 hysteresis 1: the first overflow halves the scale
        cfg[precision] = {"enabled": True, "hysteresis": 1} if precision == "fp16" else {"enabled": True}
    return cfg


def params(engine: Engine) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def new_engine(cfg: dict) -> Engine:
    torch.manual_seed(0)
    return Engine(GPT(CFG), cfg, topology=Topology.from_environment())


# ---- what each rank runs --------------------------------------------------------------------
def run_parity(rank: int, world: int, name: str, out: Path) -> None:
    stage, gas, clip, delayed, extra = PARITY[name]
    engine = new_engine(config(stage, gas, clip, delayed, extra))
    assert engine.optimizer.defaults.get("fused") is True  # the fast CPU kernel
    if "ratio" in extra:  # both placements present, as the ratio asks
        host, total = partial.offloaded_numel(engine.spaces)
        assert 0 < host < total and host >= extra["ratio"] * total, (name, host, total)
    for step in range(STEPS):
        for k in range(gas):
            engine.backward(engine(*batch(step, k, rank, world)))
            engine.step()
    engine.finish_delayed_update()
    assert engine.global_steps == STEPS and engine.skipped_steps == 0
    full = engine.consolidated_state_dict(rank0_only=False)  # stage 3 holds only shards
    state = {n: full[n] for n, _ in engine.module.named_parameters()}
    if stage < 3:  # the live parameters are the masters (fp32 here: equal)
        assert all(torch.equal(p, state[n]) for n, p in engine.module.named_parameters()), name
    torch.save(state, out / f"{name}-w{world}-r{rank}.pt")
    engine.close()


def run_bf16(rank: int, world: int, out: Path) -> None:
    cfg = config(2, 1, 1.0, False, {}, "bf16")
    cfg["precision"] = {"norms_fp32": False}  # every parameter bf16: bytes per parameter exact
    engine = new_engine(cfg)
    x, y = batch(0, 0, rank, world)
    losses = []
    for _ in range(12):  # one fixed batch per rank: the loss must fall
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    mem = engine.memory_breakdown()
    n = sum(p.numel() for p in engine.module.parameters())
    record = {"losses": losses, "per_param": {k: v / n for k, v in mem.items()}}
    (out / f"bf16-w{world}-r{rank}.json").write_text(json.dumps(record))
    torch.save(params(engine), out / f"bf16-w{world}-r{rank}.pt")


def first_element_of_rank0_shard(engine: Engine) -> nn.Parameter:
    bucket = engine.spaces[0].buckets[0]
    assert bucket.offsets[0] == bucket.start  # element 0 of this parameter is in rank 0's slice
    return bucket.params[0]


def poisoned_from_rank1(engine: Engine, rank: int) -> Dict[str, bool]:
    """While the returned flag's "on" is set, rank 1 alone puts an inf into the gradient element
    that rank 0's shard holds: only rank 0 sees it after the reduction."""
    armed = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if not armed["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad
    if rank == 1:
        first_element_of_rank0_shard(engine).register_hook(poison)
    return armed


def overflow_run(engine: Engine, rank: int, world: int, snapshot=params) -> Tuple[list, list]:
    """OVERFLOW_STEPS steps in which rank 1 alone puts an inf into rank 0's shard of the
    gradient at step K: each step's record and `snapshot(engine)` after it."""
    armed = poisoned_from_rank1(engine, rank)
    records, snaps = [], []
    for step in range(OVERFLOW_STEPS):
        armed["on"] = step == K
        engine.backward(engine(*batch(step, 0, rank, world)))
        armed["on"] = False
        engine.step()
        records.append({"applied": engine.was_step_applied(), "scale": engine.loss_scale,
                        "skipped": engine.skipped_steps})
        snaps.append(snapshot(engine))
    return records, snaps


def run_overflow(rank: int, world: int, name: str, out: Path) -> None:
    engine = new_engine(config(OVERFLOW_STAGE[name], 1, 1.0, OVERFLOW[name], {}, "fp16"))
    records, snaps = overflow_run(engine, rank, world)
    engine.finish_delayed_update()
    snaps.append(params(engine))
    torch.save(snaps, out / f"{name}-r{rank}.pt")
    (out / f"{name}-r{rank}.json").write_text(json.dumps(records))


def run_relayout(rank: int, world: int, out: Path) -> None:
    """A save, a consolidation and a precision switch of a half-offloaded stage-2 engine, with
    every all-gather's output recorded: each must fit in one bucket, never a whole space."""
    cfg = config(2, 1, 0.0, False, {"ratio": 0.5}, "bf16")
    cfg["precision"] = {"schedule": [{"step": 2, "dtype": "fp32"}]}
    engine = new_engine(cfg)
    sizes, gather = [], relayout.comm.all_gather

    def recording(output: torch.Tensor, *args, **kwargs):
        if sys._getframe(1).f_globals["__name__"] == relayout.__name__:  # not the step's gathers
            sizes.append(output.untyped_storage().nbytes() // output.element_size())
        return gather(output, *args, **kwargs)

    relayout.comm.all_gather = recording
    try:
        for step in range(3):  # the switch to fp32 re-lays the state out before step 2
            engine.backward(engine(*batch(step, 0, rank, world)))
            engine.step()
        engine.save_checkpoint(str(out / "relayout-ckpt"), async_save=False)
        engine.consolidated_state_dict()
    finally:
        relayout.comm.all_gather = gather
    largest = max(b.numel for s in engine.spaces for b in s.buckets)
    space = max(s.numel for s in engine.spaces)
    (out / f"relayout-r{rank}.json").write_text(json.dumps(
        {"gathers": sizes, "largest_bucket": largest, "largest_space": space,
         "dtype": str(engine.compute_dtype)}))
    engine.close()


def train(rank: int, world: int, out: str) -> None:
    path = Path(out)
    for name in (PARITY if world == 2 else FOUR_RANKS):
        run_parity(rank, world, name, path)
    if world == 2:
        run_bf16(rank, world, path)
        run_relayout(rank, world, path)
        for name in OVERFLOW:
            run_overflow(rank, world, name, path)


# ---- single-process references ----------------------------------------------------------------
def reference(world: int, gas: int, clip: float, delayed: bool) -> Dict[str, torch.Tensor]:
    """AdamW on the whole batch; `delayed`: gradients taken on the parameters one update behind."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend with the other processes
    try:
        return _reference(world, gas, clip, delayed)
    finally:
        torch.set_num_threads(threads)


def _reference(world: int, gas: int, clip: float, delayed: bool) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    master = GPT(CFG)
    model = copy.deepcopy(master)  # the parameters forward and backward see
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        model.zero_grad()
        for k in range(gas):
            for r in range(world):
                (model(*batch(step, k, r, world)) / (gas * world)).backward()
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        if delayed:  # update t-1 lands now: step t+1 computes on w_{t-1}
            model.load_state_dict(master.state_dict())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        if not delayed:
            model.load_state_dict(master.state_dict())
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def max_rel_err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


# ---- checks -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tuple[int, Path]:
    world = request.param
    out = tmp_path_factory.mktemp(f"offload{world}")
    spawn.run(train, world, str(out), timeout_s=180)
    return world, out


def test_offload_matches_single_process_adamw(results: Tuple[int, Path]) -> None:
    world, out = results
    for name in (PARITY if world == 2 else FOUR_RANKS):
        _, gas, clip, delayed, _ = PARITY[name]
        ref = reference(world, gas, clip, delayed)
        ranks = [torch.load(out / f"{name}-w{world}-r{r}.pt") for r in range(world)]
        for r in range(1, world):
            assert all(torch.equal(ranks[0][n], ranks[r][n]) for n in ref), (name, r)
        err = max_rel_err(ranks[0], ref)
        assert err < 5e-6, f"{name} world={world}: relative error {err:.2e}"
        if delayed:  # the stale rule is visible: the synchronous reference is far off
            assert max_rel_err(ranks[0], reference(world, gas, clip, False)) > 1e-3, name


def test_bf16_offload_converges_and_device_holds_half_params(results: Tuple[int, Path]) -> None:
    world, out = results
    if world != 2:
        pytest.skip("run at 2 ranks only")
    recs = [json.loads((out / f"bf16-w{world}-r{r}.json").read_text()) for r in range(world)]
    losses = recs[0]["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    snaps = [torch.load(out / f"bf16-w{world}-r{r}.pt") for r in range(world)]
    assert all(torch.equal(snaps[0][n], snaps[1][n]) for n in snaps[0])
    per = recs[0]["per_param"]
    # Device: bf16 parameters only (stage 2 keeps no whole gradient), no fp32 state at all.
    assert per["params"] == pytest.approx(2, rel=0.02) and per["grads"] == 0
    assert per["master_params"] == per["master_grads"] == per["optimizer_state"] == 0
    # Host: this rank's fp32 shard of masters, gradients and both Adam moments.
    for key, want in (("host_master_params", 4), ("host_master_grads", 4), ("host_optimizer_state", 8)):
        assert per[key] == pytest.approx(want / world, rel=0.02), (key, per)


def test_overflow_skips_on_every_rank_with_offload(results: Tuple[int, Path]) -> None:
    world, out = results
    if world != 2:
        pytest.skip("run at 2 ranks only")
    for name, delayed in OVERFLOW.items():
        records = [json.loads((out / f"{name}-r{r}.json").read_text()) for r in range(world)]
        snaps = [torch.load(out / f"{name}-r{r}.pt") for r in range(world)]
        assert records[0] == records[1], name
        rec = records[0]
        assert [r["applied"] for r in rec] == [s != K for s in range(OVERFLOW_STEPS)], name
        assert [r["skipped"] for r in rec] == [int(s >= K) for s in range(OVERFLOW_STEPS)], name
        assert [r["scale"] for r in rec] == [65536.0 if s < K else 32768.0 for s in range(OVERFLOW_STEPS)]
        for s in snaps:
            same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
            if delayed:  # boundary K lands update K-1; K skipped, so boundary K+1 lands nothing
                assert not same(s[K - 1], s[K]) and same(s[K], s[K + 1]), name
            else:  # the skipped step changed nothing
                assert same(s[K - 1], s[K]) and not same(s[K], s[K + 1]), name
        assert all(torch.equal(snaps[0][-1][n], snaps[1][-1][n]) for n in snaps[0][-1]), name


def test_relayout_of_offloaded_state_gathers_one_bucket_at_a_time(results: Tuple[int, Path]) -> None:
    """A checkpoint save, a consolidation and a precision switch all-gather the sharded state
    one bucket at a time: at 10B a whole fp32 space on each device would be 40 GB."""
    world, out = results
    if world != 2:
        pytest.skip("run at 2 ranks only")
    for r in range(world):
        rec = json.loads((out / f"relayout-r{r}.json").read_text())
        assert rec["dtype"] == "torch.float32"  # the schedule's switch happened
        # a save (master + two moments per space), a consolidation, the switch's export: many
        assert len(rec["gathers"]) >= 6, rec
        assert rec["largest_space"] > 2 * rec["largest_bucket"], rec  # else the check proves nothing
        assert max(rec["gathers"]) <= rec["largest_bucket"], rec
