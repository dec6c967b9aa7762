"""Gradient compression on 2 gloo ranks: top-k at ratio 1.0 and full-rank PowerSGD equal the
dense reduction at stages 0-3, error feedback loses nothing across ranks (top-k, PowerSGD, and
across runtime switches between methods), top-k 0.01 sends >= 30x fewer bytes, fp16/bf16
compression is communication_data_type half, low-rank PowerSGD trains, the step-time split is
sane and probe_bandwidth agrees on both ranks."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid_ray.engine.comm import probe_bandwidth
from hybrid_ray.engine.compression.topk import TopK
from hybrid_ray.engine import Engine
from hybrid_ray.engine.compression.powersgd import PowerSGD
from hybrid_ray.engine import Topology
from tests.distributed import spawn

pytestmark = [pytest.mark.dist]

STEPS, MICRO, WORLD = 3, 4, 2

# Stage 3: a low persistence threshold so the weight matrices are really partitioned.
S3 = {"stage3_param_persistence_threshold": 1000}
# Ranks >= every matrix's min(rows, cols); "psgdfull" runs also compress at full rank (tests
# lower PowerSGD.min_compression), where the low-rank path is exact.
PSGD_FULL = {"gradient_compression": {"type": "powersgd", "rank": 64}}

# name -> (stage, gradient accumulation, extra top-level config keys)
SCENARIOS: Dict[str, tuple] = {}
for _s in (0, 1, 2, 3):
    _z = {"zero_optimization": S3} if _s == 3 else {}
    SCENARIOS[f"dense_s{_s}"] = (_s, 2, _z)
    SCENARIOS[f"topk1_s{_s}"] = (_s, 2, {**_z, "gradient_compression": {"type": "topk", "topk_ratio": 1.0}})
    SCENARIOS[f"psgdfull_s{_s}"] = (_s, 2, {**_z, **PSGD_FULL})
_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
SCENARIOS.update({
    # The summed shard lands in the host master gradient like a reduce-scatter's result.
    "dense_s1_offload": (1, 1, _OFFLOAD),
    "topk1_s1_offload": (1, 1, {**_OFFLOAD, "gradient_compression": {"type": "topk", "topk_ratio": 1.0}}),
    "comm_fp16_s1": (1, 1, {"communication_data_type": "fp16"}),
    "gc_fp16_s1": (1, 1, {"gradient_compression": {"type": "fp16"}}),
    "comm_bf16_s2": (2, 2, {"communication_data_type": "bf16"}),
    "gc_bf16_s2": (2, 2, {"gradient_compression": {"type": "bf16"}}),
    "topk001_s2": (2, 1, {"gradient_compression": {"type": "topk", "topk_ratio": 0.01}}),
    "topk001_s0_warmup": (0, 1, {"gradient_compression": {"type": "topk", "topk_ratio": 0.01,
                                                          "warmup_steps": 2}}),
    "topk001_s3": (3, 1, {"zero_optimization": S3,
                          "gradient_compression": {"type": "topk", "topk_ratio": 0.01}}),
    # Cheaper payloads: 16-bit block indices lose nothing; int8 values round into the residual.
    "topk1_s2_block16": (2, 2, {"gradient_compression": {"type": "topk", "topk_ratio": 1.0,
                                                          "topk_indices": "block16"}}),
    "topk001_s2_int8": (2, 1, {"gradient_compression": {"type": "topk", "topk_ratio": 0.01,
                                                         "topk_values": "int8", "topk_indices": "block16"}}),
    # Every matrix is below the compression threshold at this rank: reduced densely.
    "psgd_dense_s1": (1, 2, PSGD_FULL),
    "psgd_warmup_s0": (0, 1, {"gradient_compression": {"type": "powersgd", "rank": 2, "warmup_steps": 2}}),
})


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def batch(step: int, k: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + 10 * k + rank)
    return torch.randn(MICRO, 32, generator=g), torch.randn(MICRO, 8, generator=g)


def make_engine(stage: int, gas: int, extra: dict, optimizer: dict = None, clip: float = 1.0) -> Engine:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip,
           "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 1e-2}},
           **extra, "zero_optimization": {"stage": stage, "reduce_bucket_size": 1500,
                                          **extra.get("zero_optimization", {})}}
    return Engine(model(), cfg, topology=Topology.from_environment())


def full_params(engine: Engine) -> List[torch.Tensor]:
    """Every parameter, whole, from the fp32 masters (stage 3 holds only shards)."""
    state = engine.consolidated_state_dict(rank0_only=False)
    return [state[name].clone() for name, _ in engine.module.named_parameters()]  # may alias


def train(rank: int, name: str) -> dict:
    stage, gas, extra = SCENARIOS[name]
    PowerSGD.min_compression = 0 if name.startswith("psgdfull") else 2
    engine = make_engine(stage, gas, extra)
    stats = []
    for step in range(STEPS):
        for k in range(gas):
            x, y = batch(step, k, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        stats.append(engine.compression_stats())
    params = full_params(engine)
    engine.close()
    PowerSGD.min_compression = 2
    return {"params": params, "stats": stats}


def train_all(rank: int, world: int, out: str) -> None:
    results = {name: train(rank, name) for name in SCENARIOS}
    results["feedback"] = error_feedback_run(rank, world)
    results["psgd_feedback"] = powersgd_feedback_run(rank, world)
    results["psgd_slices"] = powersgd_slices_run(rank, world)
    results["low_rank"] = {stage: low_rank_run(rank, stage) for stage in (0, 1, 2, 3)}
    results["switch"] = {stage: switch_run(rank, world, stage) for stage in (0, 1, 2, 3)}
    results["overflow"] = {stage: overflow_run(rank, stage) for stage in (1, 2)}
    results["bandwidth"] = probe_bandwidth(nbytes=1 << 20, repeats=3)
    spawn.save_result(out, rank, results)


def error_feedback_run(rank: int, world: int, steps: int = 40, numel: int = 1000) -> dict:
    """Exchange random gradients for many steps; keep what arrived, what was true, the residual."""
    topk = TopK(0.05)
    g = torch.Generator().manual_seed(7 + rank)
    received = torch.zeros(numel, dtype=torch.float64)
    true_local = torch.zeros(numel, dtype=torch.float64)
    norms = []
    for _ in range(steps):
        grad = torch.randn(numel, generator=g)
        true_local += grad.double()
        _, finish = topk.exchange((0, 0), grad, 0, numel, None)
        received += finish().double()
        topk.on_step(False, 1.0)
        norms.append(topk.residual_norm())
    true_sum = true_local.clone()
    dist.all_reduce(true_sum)
    residual_sum = topk.residuals[(0, 0)].double()
    dist.all_reduce(residual_sum)
    return {"received": received, "true": true_sum, "residual": residual_sum, "norms": norms}


def structured_grads(rank: int, steps: int, n: int = 40, m: int = 25, bias: int = 10):
    """Per-rank gradients of a 40x25 weight and its bias: a fixed rank-3 signal plus noise."""
    g = torch.Generator().manual_seed(11 + rank)
    signal = torch.randn(n, 3, generator=g) @ torch.randn(3, m, generator=g)
    for _ in range(steps):
        weight = signal + 0.1 * torch.randn(n, m, generator=g)
        yield torch.cat([weight.reshape(-1), torch.randn(bias, generator=g)])


LAYOUT = [(0, torch.Size([40, 25])), (1000, torch.Size([10]))]


def powersgd_feedback_run(rank: int, world: int, steps: int = 40) -> dict:
    """Rank-2 PowerSGD over many steps: what arrived, what was true, what is held back."""
    psgd = PowerSGD(2)
    received = torch.zeros(1010, dtype=torch.float64)
    true_local = torch.zeros(1010, dtype=torch.float64)
    norms, sent = [], 0
    for grad in structured_grads(rank, steps):
        true_local += grad.double()
        sent, finish = psgd.exchange((0, 0), grad, 0, 1010, None, LAYOUT)
        received += finish().double()
        psgd.on_step(False, 1.0)
        norms.append(psgd.residual_norm())
    dist.all_reduce(true_local)
    residual = psgd.residuals[(0, 0)].double()
    dist.all_reduce(residual)
    return {"received": received, "true": true_local, "residual": residual, "norms": norms,
            "sent_bytes": sent}


def powersgd_slices_run(rank: int, world: int, steps: int = 3) -> float:
    """Full-rank PowerSGD, each rank asking for a slice that cuts matrix rows: the dense sum."""
    psgd = PowerSGD(25)
    psgd.min_compression = 0
    lo, hi = (0, 517) if rank == 0 else (517, 1010)
    worst = 0.0
    for grad in structured_grads(rank, steps):
        dense = grad.clone()
        dist.all_reduce(dense)
        _, finish = psgd.exchange((0, 0), grad, lo, hi, None, LAYOUT)
        worst = max(worst, float((finish() - dense[lo:hi]).abs().max()))
        psgd.on_step(False, 1.0)
    return worst


def low_rank_run(rank: int, stage: int, steps: int = 15) -> dict:
    """Rank-1 PowerSGD fitting one fixed batch per rank: the loss must fall."""
    extra = {"gradient_compression": {"type": "powersgd", "rank": 1}}
    engine = make_engine(stage, 1, {**extra, "zero_optimization": S3} if stage == 3 else extra)
    x, y = batch(0, 0, rank)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    stats = engine.compression_stats()
    engine.close()
    return {"losses": losses, "stats": stats}


def overflow_run(rank: int, stage: int, steps: int = 4, poisoned: int = 1) -> dict:
    """fp16 PowerSGD; rank 1's loss is inf at one step: both ranks skip it, drop their residuals
    and warm-start Q's, and go on training from the same parameters."""
    extra = {"fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 8},
             "gradient_compression": {"type": "powersgd", "rank": 2}}
    engine = make_engine(stage, 1, extra)
    record = []
    for step in range(steps):
        x, y = batch(step, 0, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss * float("inf") if (step == poisoned and rank == 1) else loss)
        engine.step()
        psgd = engine.reducer.compressor
        record.append({"skipped": engine.skipped_steps, "scale": engine.loss_scale,
                       "residuals": len(psgd.residuals), "qs": len(psgd._q),
                       "finite": all(bool(torch.isfinite(p).all()) for p in full_params(engine))})
    params = full_params(engine)
    engine.close()
    return {"record": record, "params": params}


# Runtime switches, at the optimizer step where each takes effect.
SWITCHES = {2: {"type": "topk", "topk_ratio": 0.05}, 4: {"type": "powersgd", "rank": 2}, 7: None}
SWITCH_STEPS, SWITCH_LR = 9, 0.1


def true_grads(ref: nn.Module, params: List[torch.Tensor], step: int, rank: int,
               gas: int) -> List[torch.Tensor]:
    """This rank's gradient for one window at `params`, computed by plain torch."""
    with torch.no_grad():
        for p, value in zip(ref.parameters(), params):
            p.copy_(value)
    ref.zero_grad()
    for k in range(gas):
        x, y = batch(step, k, rank)
        (nn.functional.mse_loss(ref(x), y) / gas).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def held_back(engine: Engine) -> List[torch.Tensor]:
    """This rank's error-feedback residuals (the compressor's and those carried over from a
    switched-away method), laid out per parameter."""
    reducer = engine.reducer
    pending = dict(reducer.carry)
    for key, r in (reducer.compressor.residuals if reducer.compressor else {}).items():
        pending[key] = pending[key] + r if key in pending else r
    views = {}
    for si, space in enumerate(engine.spaces):
        flat = torch.zeros(space.numel)
        for b in space.buckets:
            if (si, b.index) in pending:
                flat[b.start:b.start + b.numel] += pending[(si, b.index)]
        views.update((id(p), v) for p, v in zip(space.ordered_params(), space.views_of(flat)))
    return [views[id(p)].clone() for p in engine.module.parameters()]


def switch_run(rank: int, world: int, stage: int) -> List[dict]:
    """dense -> topk -> powersgd -> dense under SGD: after every step, the sum of applied
    reductions (read off the parameters) plus every rank's held-back residual must equal the
    sum of all ranks' true gradients."""
    gas = 2
    engine = make_engine(stage, gas, {"zero_optimization": S3} if stage == 3 else {},
                         optimizer={"type": "SGD", "params": {"lr": SWITCH_LR}}, clip=0.0)
    ref = model()
    start = full_params(engine)
    true_sum = [torch.zeros_like(p) for p in start]
    records = []
    for step in range(SWITCH_STEPS):
        if step in SWITCHES:
            engine.set_gradient_compression(SWITCHES[step])
        for total, g in zip(true_sum, true_grads(ref, full_params(engine), step, rank, gas)):
            dist.all_reduce(g)
            total += g
        for k in range(gas):
            x, y = batch(step, k, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        held = held_back(engine)
        for h in held:
            dist.all_reduce(h)
        # SGD: params move by -lr * (reduced sum) / world, so the sum applied so far is:
        applied = [(a - b) * world / SWITCH_LR for a, b in zip(start, full_params(engine))]
        scale = max(float(t.abs().max()) for t in true_sum)
        err = max(float((a + h - t).abs().max()) for a, h, t in zip(applied, held, true_sum)) / scale
        records.append({"type": engine.gradient_compression["type"], "err": err,
                        "held": sum(float(h.norm()) for h in held),
                        "ratio": engine.compression_stats()["ratio"]})
    engine.close()
    return records


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> List[dict]:
    out = tmp_path_factory.mktemp("compression")
    spawn.run(train_all, WORLD, str(out), timeout_s=60)
    return spawn.results(str(out), WORLD)


def assert_params_close(a: List[torch.Tensor], b: List[torch.Tensor], atol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("case", ["s0", "s1", "s2", "s3", "s1_offload"])
def test_topk_ratio_one_equals_dense(results, case):
    for r in results:  # observed bit-identical: rank order of the sparse sum matches gloo's
        assert_params_close(r[f"topk1_{case}"]["params"], r[f"dense_{case}"]["params"], 1e-6)
    # Every rank applied the same update.
    assert_params_close(results[0][f"topk1_{case}"]["params"], results[1][f"topk1_{case}"]["params"], 0)


@pytest.mark.parametrize("gc, comm", [("gc_fp16_s1", "comm_fp16_s1"), ("gc_bf16_s2", "comm_bf16_s2")])
def test_half_compression_is_half_reduction(results, gc, comm):
    for r in results:
        assert_params_close(r[gc]["params"], r[comm]["params"], 0)
        last = r[gc]["stats"][-1]
        assert last["ratio"] == pytest.approx(2.0) and last["bytes_sent"] > 0


def test_topk_001_sends_30x_fewer_bytes(results):
    for r in results:
        for last in r["topk001_s2"]["stats"]:
            assert last["ratio"] >= 30, last
        dense = r["dense_s2"]["stats"][-1]
        # dense_s2 reduces twice per step (accumulation 2 at stage 2), topk001_s2 once.
        assert r["topk001_s2"]["stats"][-1]["dense_bytes"] * 2 == dense["dense_bytes"]
        assert dense["ratio"] == 1.0


def test_cheaper_topk_payloads(results):
    for r in results:  # block16 indices are exact: the same update as dense
        assert_params_close(r["topk1_s2_block16"]["params"], r["dense_s2"]["params"], 1e-6)
        # int8 values and block16 indices: 3 bytes per kept element instead of 8
        cheap, plain = r["topk001_s2_int8"]["stats"][-1], r["topk001_s2"]["stats"][-1]
        # (less on buckets this small: a scale per 256 values and a count per index block)
        assert 2.2 < cheap["ratio"] / plain["ratio"] < 2.7 and cheap["ratio"] >= 80, (cheap, plain)
    assert_params_close(results[0]["topk001_s2_int8"]["params"], results[1]["topk001_s2_int8"]["params"], 0)


def test_warmup_starts_dense_and_reaches_ratio(results):
    ratios = [s["ratio"] for s in results[0]["topk001_s0_warmup"]["stats"]]
    assert ratios[0] == pytest.approx(0.5, rel=0.05)  # density 1: 8 bytes per element against 4
    assert ratios[0] < ratios[1] < ratios[2] and ratios[2] >= 30


def assert_feedback_tracks(fb: dict, max_lag: float) -> None:
    # Nothing is lost: what arrived plus what is still held back is the sum of all gradients.
    torch.testing.assert_close(fb["received"] + fb["residual"], fb["true"], atol=1e-4, rtol=0)
    # The residual stays bounded (it does not grow with the number of steps).
    norms = fb["norms"]
    assert max(norms[20:]) < 2 * max(norms[:20])
    assert (fb["received"] - fb["true"]).norm() < max_lag * fb["true"].norm()


def test_error_feedback_tracks_true_gradient_sum(results):
    for r in results:
        assert_feedback_tracks(r["feedback"], 0.5)


def test_topk_001_at_stage3_sends_30x_fewer_bytes(results):
    for r in results:
        for last in r["topk001_s3"]["stats"]:
            assert last["ratio"] >= 30, last


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_powersgd_full_rank_equals_dense(results, stage):
    for r in results:  # the low-rank path at rank min(rows, cols): exact up to fp32 rounding
        assert_params_close(r[f"psgdfull_s{stage}"]["params"], r[f"dense_s{stage}"]["params"], 1e-5)
    assert_params_close(results[0][f"psgdfull_s{stage}"]["params"],
                        results[1][f"psgdfull_s{stage}"]["params"], 0)


def test_powersgd_that_must_equal_dense_does(results):
    # rank 64 saves nothing on these matrices: every entry is reduced densely.
    for r in results:
        assert_params_close(r["psgd_dense_s1"]["params"], r["dense_s1"]["params"], 1e-6)
        assert r["psgd_dense_s1"]["stats"][-1]["ratio"] == pytest.approx(1.0)


def test_powersgd_warmup_reduces_densely_first(results):
    ratios = [s["ratio"] for s in results[0]["psgd_warmup_s0"]["stats"]]
    assert ratios[0] == ratios[1] == pytest.approx(1.0) and ratios[2] > 4


def test_powersgd_error_feedback_tracks_true_gradient_sum(results):
    for r in results:
        fb = r["psgd_feedback"]
        assert_feedback_tracks(fb, 0.2)
        # P (40x2) and Q (25x2) and the dense bias against 1010 values.
        assert fb["sent_bytes"] == (80 + 50 + 10) * 4


def test_powersgd_slices_that_cut_rows_are_exact(results):
    for r in results:
        assert r["psgd_slices"] < 1e-4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_powersgd_low_rank_trains(results, stage):
    # The ranks fit different batches: their summed loss is what the shared model minimises.
    total = [a + b for a, b in zip(*(r["low_rank"][stage]["losses"] for r in results))]
    assert total[-1] < 0.5 * total[0], total
    for r in results:
        # rank 1: rows + cols values per compressed matrix; biases and the 8x64 head go dense
        assert r["low_rank"][stage]["stats"]["ratio"] > 10


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_switch_dense_topk_powersgd_dense_loses_nothing(results, stage):
    for r in results:
        records = r["switch"][stage]
        assert [x["type"] for x in records] == ["none"] * 2 + ["topk"] * 2 + ["powersgd"] * 3 + ["none"] * 2
        for x in records:  # applied + held back == sum of true gradients, after every step
            assert x["err"] < 1e-4, records
        assert all(x["held"] > 0 for x in records[2:7])
        assert records[-1]["held"] == 0 and records[1]["held"] == 0
        assert records[3]["ratio"] > 5 and records[6]["ratio"] > 3 and records[-1]["ratio"] == 1.0
    assert results[0]["switch"][stage] == results[1]["switch"][stage]


@pytest.mark.parametrize("name", ["dense_s1", "topk001_s2", "psgdfull_s2", "topk001_s3"])
def test_step_time_split_is_sane(results, name):
    for r in results:
        for st in r[name]["stats"]:
            assert 0 < st["step_s"] < 10
            assert 0 <= st["comm_wait_s"] <= st["step_s"]
            assert 0 <= st["compress_s"] <= st["step_s"]
            assert (st["compress_s"] > 0) == (not name.startswith("dense"))


def test_probe_bandwidth_is_positive_and_equal_on_both_ranks(results):
    bw = [r["bandwidth"] for r in results]
    assert bw[0] == bw[1] and 0 < bw[0] < float("inf")


@pytest.mark.parametrize("stage", [1, 2])
def test_powersgd_overflow_skips_on_both_ranks_and_drops_residuals(results, stage):
    for r in results:
        rec = r["overflow"][stage]["record"]
        assert [x["skipped"] for x in rec] == [0, 1, 1, 1]
        assert rec[1]["scale"] == rec[0]["scale"] / 2 == rec[2]["scale"]
        assert rec[1]["residuals"] == rec[1]["qs"] == 0  # they held inf/NaN
        assert rec[0]["residuals"] > 0 and rec[2]["residuals"] > 0
        assert all(x["finite"] for x in rec)
    assert_params_close(results[0]["overflow"][stage]["params"], results[1]["overflow"][stage]["params"], 0)
