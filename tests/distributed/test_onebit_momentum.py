"""onebit's momentum form (compression/onebit_momentum.py) on 2 gloo ranks.

The exchange against an in-process reference of 1-bit Adam's two-level momentum average built
from the same codec (seeded from the optimizer's momentum, then carrying its own; each rank's
gradient clipped by its own norm across every bucket; error feedback at both levels), and the
engine at stages 0-2: "auto" picks this form, the optimizer's momentum is the decoded
average every rank holds, ranks stay equal, stage 2 (which then reduces at the window's
boundary) trains bit for bit as stage 1 with and without gradient accumulation, an fp16 overflow
after the warm-up keeps the last average, the gradient form is still there when asked for, and a
run switched into this form and out again mid-run (the driver's `auto`) freezes and thaws Adam's
variance where it should.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid_ray.engine import Engine, Topology
from hybrid_ray.engine.compression.onebit import _bounds, decode, decode_rows, encode
from hybrid_ray.engine.compression.onebit_momentum import OneBitMomentum
from tests.distributed import spawn
from tests.distributed.test_compression import full_params, model
from tests.distributed.test_onebit import MICRO, batch

pytestmark = [pytest.mark.dist]

WORLD, BETA, WARMUP, STEPS = 2, 0.9, 2, 6
SEED = torch.randn(1001, generator=torch.Generator().manual_seed(7))  # the optimizer's momentum
# (bucket sizes, whole buckets (stage 0) or slices, gradient_clipping, loss scale)
CASES = {"slice": ([1000, 300], False, 0.0, 1.0), "whole": ([1001, 301], True, 0.0, 1.0),
         "clipped": ([1000, 300], False, 0.5, 8.0)}


class FixedSource:
    """A MomentumSource whose optimizer momentum is SEED at every bucket."""

    def __init__(self, clip: float, scale: float):
        self.clip, self.scale = clip, scale

    def beta1(self, key) -> float:
        return BETA

    def owned_momentum(self, key, begin: int, end: int) -> torch.Tensor:
        return SEED[begin:end]

    def step_scalars(self):
        return self.scale, self.clip


def grads_of(rank: int, step: int, bucket: int, numel: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * bucket + rank)
    return torch.randn(numel, generator=g) * scale


def exchange_run(rank: int) -> dict:
    out = {}
    for name, (sizes, whole, clip, scale) in CASES.items():
        c = OneBitMomentum(warmup_steps=0)
        c.source = FixedSource(clip, scale)
        got, sent = [], 0
        for step in range(3):
            finishes = []
            for k, n in enumerate(sizes):
                lo, hi = (0, n) if whole else (rank * n // 2, (rank + 1) * n // 2)
                sent, finish = c.exchange((0, k), grads_of(rank, step, k, n, scale), lo, hi, None)
                finishes.append(finish)
            got.append([f() for f in finishes])
            c.on_step(False, 1.0)
        out[name] = {"got": got, "sent": sent}
    out["restored"] = restored_run(rank)
    return out


def restored_run(rank: int) -> dict:
    """A compressor rebuilt from another's state_dict (a buddy's copy) goes on as it would have."""
    sizes = CASES["slice"][0]
    a, b = OneBitMomentum(warmup_steps=0), OneBitMomentum(warmup_steps=0)
    a.source = b.source = FixedSource(0.0, 1.0)

    def step(c, s):
        fins = [c.exchange((0, k), grads_of(rank, s, k, n, 1.0), rank * n // 2, (rank + 1) * n // 2, None)[1]
                for k, n in enumerate(sizes)]
        out = [f() for f in fins]
        c.on_step(False, 1.0)
        return out
    for s in range(2):
        step(a, s)
    b.load_state_dict(a.state_dict(), torch.device("cpu"))
    return {"original": step(a, 2), "restored": step(b, 2)}


def reference(sizes, whole: bool, clip: float, scale: float, steps: int = 3) -> list:
    """What each rank should receive: result[step][rank][bucket]."""
    shared, worker, server, results = {}, {}, {}, []
    for step in range(steps):
        grads = [[grads_of(r, step, k, n, scale) for k, n in enumerate(sizes)] for r in range(WORLD)]
        coefs = []
        for r in range(WORLD):
            local = math.sqrt(sum(float(g.double().square().sum()) for g in grads[r])) / scale
            coefs.append(min(1.0, clip / (local + 1e-6)) if clip > 0 else 1.0)
        new = {}
        for k, n in enumerate(sizes):
            bounds = _bounds(n, WORLD)
            decoded = [[None] * WORLD for _ in range(WORLD)]  # [sender][owner]
            for r in range(WORLD):
                x = grads[r][k].clone().mul_((1 - BETA) * coefs[r])
                if k in shared:
                    x.add_(shared[k], alpha=BETA / WORLD)
                if (k, r) in worker:
                    x.add_(worker[(k, r)])
                for j, (a, b) in enumerate(bounds):
                    payload, sent = encode(x[a:b])
                    x[a:b].sub_(sent)
                    decoded[r][j] = decode(payload, b - a)
                worker[(k, r)] = x
            parts = []
            for j, (a, b) in enumerate(bounds):
                total = sum(decoded[r][j] for r in range(WORLD))
                if k not in shared:
                    total.add_(SEED[a:b], alpha=BETA * scale * WORLD)
                if (k, j) in server:
                    total.add_(server[(k, j)])
                payload, sent = encode(total)
                server[(k, j)] = total.sub_(sent)
                parts.append(decode(payload, b - a))
            new[k] = torch.cat(parts)
        shared = new
        results.append([[shared[k] if whole else shared[k][r * n // 2:(r + 1) * n // 2]
                         for k, n in enumerate(sizes)] for r in range(WORLD)])
    return results


def make_engine(stage: int, form: str = "auto", fp16: bool = False, gas: int = 1, dense: bool = False) -> Engine:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
           "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "gradient_compression": {"type": "none"} if dense else
           {"type": "onebit", "warmup_steps": WARMUP, "form": form},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1500}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "hysteresis": 1, "initial_scale_power": 8}
    return Engine(model(), cfg, topology=Topology.from_environment())


def held_momentum(engine: Engine) -> list:
    """(the optimizer's momentum, the decoded shared average * the unscale factor) over this
    rank's elements of every bucket, where the variance is not zero."""
    c, out = engine.reducer.compressor, []
    coef = 1.0 / engine.zero.grad_divisor(engine.zero.step_scalars()[0])
    for key, rows in sorted(c.shared.items()):
        g = engine.reducer.grads[key[0]]
        b = g.space.buckets[key[1]]
        lo, hi = b.shard_range(g.space.rank, g.space.num_shards)
        held = c.source.owned_momentum(key, lo - b.start, hi - b.start)
        avg = decode_rows(rows, _bounds(b.numel, WORLD), lo - b.start, hi - b.start) * coef
        state = engine.optimizer.state[engine.zero.masters[key[0]]]
        off = g.shard_offset[key[1]]
        nonzero = state["exp_avg_sq"][off:off + hi - lo] != 0
        out.append((held[nonzero].clone(), avg[nonzero]))
    return out


def train(rank: int, stage: int, form: str = "auto", fp16: bool = False, poisoned: int = -1) -> dict:
    engine = make_engine(stage, form, fp16)
    record = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss * float("inf") if (step == poisoned and rank == 1) else loss)
        engine.step()
        c = engine.reducer.compressor
        record.append({"loss": float(loss), "skipped": engine.skipped_steps,
                       "shared": {k: v.clone() for k, v in getattr(c, "shared", {}).items()},
                       "held": held_momentum(engine) if hasattr(c, "shared") else [],
                       "ratio": engine.compression_stats()["ratio"]})
    out = {"record": record, "params": full_params(engine), "kind": type(engine.reducer.compressor).__name__}
    engine.close()
    return out


def accumulated(rank: int, stage: int, gas: int) -> list:
    """Parameters after STEPS optimizer steps of `gas` micro-batches each."""
    engine = make_engine(stage, gas=gas)
    for micro in range(STEPS * gas):
        x, y = batch(micro, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == STEPS and type(engine.reducer.compressor).__name__ == "OneBitMomentum"
    params = full_params(engine)
    engine.close()
    return params


def switched(rank: int) -> dict:
    """Dense for 2 steps, then the momentum form (warm-up 1) for 4, then dense for 2, switched
    between steps as the driver's `auto` policy does; beside it a run that stays dense."""
    engine, dense = make_engine(2, dense=True), make_engine(2, dense=True)
    out = {"ratio": [], "variance": []}
    for step in range(8):
        if step == 2:
            engine.set_gradient_compression({"type": "onebit", "form": "momentum", "warmup_steps": 1})
        if step == 6:
            engine.set_gradient_compression(None)
        x, y = batch(step, rank)
        for e in (engine, dense):
            e.backward(nn.functional.mse_loss(e(x), y))
            e.step()
        out["ratio"].append(engine.compression_stats()["ratio"])
        out["variance"].append(torch.cat([engine.optimizer.state[m]["exp_avg_sq"].reshape(-1).clone()
                                          for m in engine.zero.masters]))
        if step == 2:  # the switch's warm-up step reduces densely: still the dense run
            out["warm_up_equal"] = all(torch.equal(a, b) for a, b in zip(full_params(engine), full_params(dense)))
    out["params"] = full_params(engine)
    engine.close()
    dense.close()
    return out


def resume_run(rank: int, out: str) -> dict:
    """Saved after 8 steps with the residuals folded into the saved momentum, and once without;
    the live run goes on, and so does one never saved."""
    def steps(engine: Engine, start: int, stop: int) -> Engine:
        for step in range(start, stop):
            x, y = batch(step, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        return engine

    def loaded_momentum(tag: str) -> torch.Tensor:
        e = make_engine(1)
        e.load_checkpoint(out, tag=tag)
        got = torch.cat([e.optimizer.state[m]["exp_avg"].reshape(-1) for m in e.zero.masters])
        e.close()
        return got

    live = steps(make_engine(1), 0, 8)
    c = live.reducer.compressor
    owed = []  # what the residuals owe this rank's chunks, in the optimizer's units
    for key in sorted(c.residuals):
        debt = c.residuals[key].clone()
        dist.all_reduce(debt)
        a, b = _bounds(debt.numel(), WORLD)[rank]
        owed.append((debt[a:b] + c.server[key]) / (BETA * WORLD))  # fp32: loss scale 1
    live.save_checkpoint(out, tag="fold")
    live.wait_checkpoint()
    fold = c.fold_debt
    c.fold_debt = lambda: (lambda: None)  # a checkpoint as it was before
    live.save_checkpoint(out, tag="nofold")
    live.wait_checkpoint()
    c.fold_debt = fold
    res = {"owed": torch.cat(owed), "went_on_params": full_params(steps(live, 8, 12))}
    live.close()
    unsaved = steps(make_engine(1), 0, 12)
    res["unsaved_params"] = full_params(unsaved)
    unsaved.close()
    res["fold"], res["nofold"] = loaded_momentum("fold"), loaded_momentum("nofold")
    return res


def run_all(rank: int, world: int, out: str) -> None:
    res = {"exchange": exchange_run(rank), "resume": resume_run(rank, str(Path(out) / "ckpt"))}
    for stage in (0, 1, 2):
        res[stage] = {"auto": train(rank, stage), "gradient": train(rank, stage, "gradient")}
    res["gas"] = {stage: accumulated(rank, stage, 2) for stage in (1, 2)}
    res["fp16"] = train(rank, 1, fp16=True, poisoned=WARMUP + 1)
    res["switched"] = switched(rank)
    spawn.save_result(out, rank, res)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("onebit_momentum")
    spawn.run(run_all, WORLD, str(out), timeout_s=240)
    return spawn.results(str(out), WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_exchange_equals_the_two_level_momentum_reference(results, case):
    sizes, whole, clip, scale = CASES[case]
    want = reference(sizes, whole, clip, scale)
    for r, res in enumerate(results):
        for step, got in enumerate(res["exchange"][case]["got"]):
            for k, t in enumerate(got):
                assert torch.equal(t, want[step][r][k]), (case, step, r, k)
    # bytes handed to collectives for the last bucket: each owner's chunk and the served row
    n = sizes[-1]
    assert results[0]["exchange"][case]["sent"] == 2 * ((n // 2 + 7) // 8 + 4) + -(-((n // 2 + 7) // 8 + 4) // 4) * 4


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_auto_picks_the_momentum_form_and_the_optimizer_holds_the_shared_average(results, stage):
    for res in results:
        auto = res[stage]["auto"]
        assert auto["kind"] == "OneBitMomentum" and res[stage]["gradient"]["kind"] == "OneBit"
        for rec in auto["record"][WARMUP:]:
            assert rec["held"]
            for held, avg in rec["held"]:
                torch.testing.assert_close(held, avg, rtol=1e-6, atol=0)
        assert auto["record"][-1]["ratio"] >= 20
    for form in ("auto", "gradient"):
        for a, b in zip(results[0][stage][form]["params"], results[1][stage][form]["params"]):
            assert torch.equal(a, b)
        losses = [r["loss"] for r in results[0][stage][form]["record"]]
        assert losses[-1] < losses[0], (form, losses)


def test_stage_2_trains_as_stage_1_with_and_without_accumulation(results):
    """After the warm-up stage 2 holds each rank's whole window gradient (the momentum term
    needs it) and reduces at the boundary: the same exchange, bit for bit."""
    for res in results:
        for a, b in zip(res[1]["auto"]["params"], res[2]["auto"]["params"]):
            assert torch.equal(a, b)
        for a, b in zip(res["gas"][1], res["gas"][2]):
            assert torch.equal(a, b)
        assert not all(torch.equal(a, b) for a, b in zip(res["gas"][2], res[2]["auto"]["params"]))


def test_an_overflow_after_the_warm_up_keeps_the_last_average(results):
    for res in results:
        rec = res["fp16"]["record"]
        poisoned = WARMUP + 1
        assert [r["skipped"] for r in rec] == [0] * poisoned + [1] * (STEPS - poisoned)
        before, after = rec[poisoned - 1]["shared"], rec[poisoned]["shared"]
        assert before and before.keys() == after.keys()
        for k in before:  # the same bits; the scale follows the halved loss scale
            assert torch.equal(before[k][:, 4:], after[k][:, 4:])
            torch.testing.assert_close(after[k].view(torch.float32)[:, 0], before[k].view(torch.float32)[:, 0] / 2)
        assert rec[-1]["shared"].keys() == before.keys()
    for a, b in zip(results[0]["fp16"]["params"], results[1]["fp16"]["params"]):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


def test_a_compressor_restored_from_its_state_dict_goes_on_bit_for_bit(results):
    for res in results:
        r = res["exchange"]["restored"]
        assert all(torch.equal(x, y) for x, y in zip(r["original"], r["restored"]))


def test_a_checkpoint_carries_what_the_residuals_owed(results):
    """The residuals are not saved (per rank and layout); what they owe each owner's chunk is
    folded into the saved momentum (as debt / beta1: a resume's first exchange adds beta1 times
    the owners' momentum), and saving changes nothing in the run that goes on."""
    for res in results:
        r = res["resume"]
        assert all(torch.equal(a, b) for a, b in zip(r["went_on_params"], r["unsaved_params"]))
        assert r["owed"].norm() > 0.1 * r["nofold"].norm()  # a debt worth carrying
        # this rank's shard, loaded at the same layout: its chunks of every bucket, in order
        # (the buckets' padding belongs to no parameter: a checkpoint has no momentum for it)
        held = r["nofold"] != 0
        assert held.float().mean() > 0.9
        torch.testing.assert_close((r["fold"] - r["nofold"])[held], r["owed"][held], rtol=1e-4, atol=1e-6)


def test_switched_in_and_out_mid_run_as_the_driver_does(results):
    for res in results:
        r = res["switched"]
        assert r["warm_up_equal"]
        assert all(x >= 20 for x in r["ratio"][3:6]) and all(x < 1.5 for x in r["ratio"][6:])
        v = r["variance"]
        assert all(torch.equal(v[2], v[k]) for k in (3, 4, 5))  # frozen after the switch's warm-up
        assert not torch.equal(v[5], v[6]) and not torch.equal(v[6], v[7])  # Adam's again once dense
    for a, b in zip(results[0]["switched"]["params"], results[1]["switched"]["params"]):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
