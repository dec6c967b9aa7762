"""Gradient compression without a process group: config, top-k selection, error feedback,
warm-up, PowerSGD's matricisation, the step-time split, runtime switching on one rank."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from hybrid_ray.config import ConfigError, load_config
from hybrid_ray.engine.comm import probe_bandwidth
from hybrid_ray.engine.compression.stats import CommStats, StepTimer
from hybrid_ray.engine.compression.codec import BLOCK, PairCodec
from hybrid_ray.engine.compression.topk import TopK
from hybrid_ray.engine import Engine
from hybrid_ray.engine.compression.powersgd import PowerSGD, _Plan
from hybrid_ray.engine.compression import Reduction
from hybrid_ray.engine.zero.reducer import GradReducer, ReduceOptions
from hybrid_ray.engine import Topology


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return str(info.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["none", "topk", "powersgd", "fp16", "bf16"])
def test_supported_types_load(kind, stage):
    cfg = load_config({"train_batch_size": 1,
                       "gradient_compression": {"type": kind, "topk_ratio": 0.1, "warmup_steps": 5,
                                                "rank": 4, "error_feedback": False},
                       "zero_optimization": {"stage": stage}})
    assert cfg.gradient_compression.type == kind


@pytest.mark.parametrize("raw, message", [
    ({"gradient_compression": {"type": "gzip"}}, "gradient_compression.type: "),
    ({"gradient_compression": {"topk_ratio": 0}}, "gradient_compression.topk_ratio: out of range; got 0"),
    ({"gradient_compression": {"warmup_steps": -1}}, "gradient_compression.warmup_steps: out of range"),
    ({"gradient_compression": {"type": "powersgd", "rank": 0}}, "gradient_compression.rank: out of range"),
    ({"gradient_compression": {"error_feedbak": True}},
     "gradient_compression.error_feedbak: unknown key; did you mean 'error_feedback'?"),
    ({"gradient_compression": {"type": "fp16"}, "communication_data_type": "bf16"},
     "gradient_compression.type, communication_data_type: contradiction; got 'fp16' and 'bf16'"),
])
def test_config_errors_name_the_key(raw, message):
    assert error_of(raw).startswith(message)


def test_half_compression_agrees_with_equal_communication_dtype():
    cfg = load_config({"train_batch_size": 1, "gradient_compression": {"type": "bf16"},
                       "communication_data_type": "bf16"})
    assert cfg.communication_data_type == "bf16"


def test_select_keeps_largest_and_residual_is_the_rest_exactly():
    topk = TopK(0.25)
    grad = torch.tensor([1.0, -8.0, 2.0, 0.5, 3.0, -4.0, 0.0, 1.5])
    idx, values, _ = topk.select((0, 0), grad)
    assert sorted(idx.tolist()) == [1, 5]
    dense = torch.zeros(8).index_add_(0, idx.long(), values)
    assert torch.equal(dense + topk.residuals[(0, 0)], grad)
    assert grad[1] == -8.0  # the caller's buffer is never modified


def test_error_feedback_sum_sent_plus_residual_equals_sum_of_gradients():
    # Integer-valued gradients: every sum is exact in fp32, so the identity holds bit for bit.
    topk, g = TopK(0.05), torch.Generator().manual_seed(0)
    sent, true = torch.zeros(500), torch.zeros(500)
    norms = []
    for _ in range(200):
        grad = torch.randint(-50, 51, (500,), generator=g).float()
        true += grad
        idx, values, _ = topk.select((0, 3), grad)
        sent.index_add_(0, idx.long(), values)
        topk.on_step(False, 1.0)
        norms.append(topk.residual_norm())
    assert torch.equal(sent + topk.residuals[(0, 3)], true)
    assert max(norms[100:]) < 2 * max(norms[:100])  # bounded: no growth with the step count


@pytest.mark.parametrize("values,indices", [("fp32", "int32"), ("bf16", "block16"), ("int8", "block16"),
                                            ("int8", "int32")])
def test_cheaper_payloads_decode_to_what_the_residual_left_out(values, indices):
    # Whatever the encoding, a receiver decodes exactly the values the sender took out of its
    # residual: sent + residual is the gradient (to fp32 rounding of the subtraction), and the
    # bytes are the codec's size.
    codec = PairCodec(values, indices)
    topk, g = TopK(0.05, codec=codec), torch.Generator().manual_seed(0)
    numel = 3 * BLOCK + 1000  # several index blocks, the last one partial
    sent_sum, true = torch.zeros(numel), torch.zeros(numel)
    for _ in range(5):
        grad = torch.randn(numel, generator=g)
        true += grad
        idx, sent, payload = topk.select((0, 0), grad)
        k = idx.numel()
        assert payload.dtype == torch.uint8 and payload.numel() == codec.nbytes(k, numel)
        got_idx, got_values = codec.decode(payload, k, numel)
        assert torch.equal(got_idx, idx.long()) and torch.equal(got_values, sent)
        sent_sum.index_add_(0, got_idx, got_values)
    assert torch.allclose(sent_sum + topk.residuals[(0, 0)], true, atol=1e-5)
    per_element = codec.nbytes(k, numel) / k
    assert per_element == pytest.approx({("fp32", "int32"): 8, ("bf16", "block16"): 4,
                                         ("int8", "block16"): 3, ("int8", "int32"): 5}[(values, indices)], rel=0.02)


def test_int8_rounding_goes_into_the_residual():
    topk = TopK(1.0, codec=PairCodec("int8", "int32"))
    grad = torch.tensor([1.0, 0.3, -0.7, 0.001])
    idx, sent, _ = topk.select((0, 0), grad)
    dense = torch.zeros(4).index_add_(0, idx.long(), sent)
    assert dense[3] == 0.0 and not torch.equal(dense, grad)  # 0.001 is below the chunk's int8 step
    assert torch.allclose(dense + topk.residuals[(0, 0)], grad, atol=1e-7)


def test_without_error_feedback_no_residual_is_kept():
    topk = TopK(0.1, error_feedback=False)
    topk.select((0, 0), torch.randn(100))
    assert topk.residuals == {}


def test_warmup_density_decays_exponentially_to_ratio():
    topk = TopK(0.01, warmup_steps=4)
    densities = []
    for _ in range(6):
        densities.append(topk.density())
        topk.on_step(False, 1.0)
    assert densities[0] == 1.0
    assert densities[2] == pytest.approx(0.1)  # 0.01 ** (2/4)
    assert densities[4:] == [0.01, 0.01]
    assert TopK(0.01).k_for(1000) == 10 and TopK(0.01).k_for(10) == 1


def test_residual_follows_loss_scale_and_is_dropped_on_overflow():
    topk = TopK(0.5)
    topk.select((0, 0), torch.tensor([4.0, 1.0]))
    topk.on_step(False, 0.5)  # loss scale halved: the residual is in the old units
    assert torch.equal(topk.residuals[(0, 0)], torch.tensor([0.0, 0.5]))
    topk.on_step(True, 0.5)
    assert topk.residuals == {}


def test_stats_report_the_last_step():
    stats = CommStats()
    stats.add(10, 400)
    stats.add(10, 400)
    stats.end_step()
    assert stats.summary()["ratio"] == 40 and stats.summary()["bytes_sent"] == 20
    stats.end_step()
    assert stats.summary()["ratio"] == 1.0 and stats.summary()["total_bytes_sent"] == 20


def test_stats_report_the_step_time_split():
    stats = CommStats()
    stats.end_step({"comm_wait": 0.25, "compress": 0.5})
    stats.record_step_time(2.0)
    summary = stats.summary()
    assert (summary["step_s"], summary["comm_wait_s"], summary["compress_s"]) == (2.0, 0.25, 0.5)


def test_step_timer_accumulates_per_kind_and_resets():
    timer = StepTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.span("compress"):
            sum(range(1000))
    first = timer.collect()
    assert set(first) == {"compress"} and first["compress"] > 0
    assert timer.collect() == {}


# ---- PowerSGD ---------------------------------------------------------------------------

def test_powersgd_plan_compresses_matrices_and_keeps_small_and_1d_tensors_dense():
    layout = [(0, torch.Size([64, 32])),      # 2048 values, rank 4: 384 values of factors
              (2048, torch.Size([64])),        # a bias: dense
              (2112, torch.Size([4, 3])),      # factors would not halve it: dense
              (2124, torch.Size([16, 2, 3, 3]))]  # a conv: 16 x 18, compressed
    plan = _Plan(layout, 4, 0, 2412, torch.device("cpu"), 2.0)
    assert [(m.offset, m.rows, m.cols, m.rank) for m in plan.mats] == [(0, 64, 32, 4), (2124, 16, 18, 4)]
    assert plan.dense_index.tolist() == list(range(2048, 2124))
    assert plan.p_numel == (64 + 16) * 4 and plan.q_numel == (32 + 18) * 4
    # A slice [2100, 2412) keeps the dense entries from 2100 on, at their place in the slice.
    part = _Plan(layout, 4, 2100, 2412, torch.device("cpu"), 2.0)
    assert part.dense_out.tolist() == list(range(0, 24))
    assert part.dense_mine.tolist() == list(range(52, 76))


def test_powersgd_rank_is_capped_per_matrix_and_full_rank_is_dense_by_default():
    assert _Plan([(0, torch.Size([8, 64]))], 16, 0, 512, torch.device("cpu"), 2.0).mats == []
    plan = _Plan([(0, torch.Size([8, 64]))], 16, 0, 512, torch.device("cpu"), 0.0)
    assert plan.mats[0].rank == 8


def test_powersgd_decompress_forms_only_the_rows_of_the_slice():
    torch.manual_seed(0)
    layout = [(0, torch.Size([6, 5]))]
    phat, q = torch.linalg.qr(torch.randn(6, 2)).Q, torch.randn(5, 2)
    whole = (phat @ q.t()).reshape(-1)
    plan = _Plan(layout, 2, 7, 23, torch.device("cpu"), 0.0)
    out = PowerSGD._decompress(plan, torch.empty(0), [phat], [q], 7, 23)
    torch.testing.assert_close(out, whole[7:23])


def test_powersgd_residual_follows_loss_scale_and_overflow_drops_residual_and_q():
    psgd = PowerSGD(2)
    psgd.residuals[(0, 0)] = torch.tensor([4.0, 2.0])
    psgd._q[((0, 0), 0)] = torch.ones(3, 2)
    psgd.on_step(False, 0.5)
    assert torch.equal(psgd.residuals[(0, 0)], torch.tensor([2.0, 1.0])) and psgd._q
    psgd.on_step(True, 0.5)
    assert psgd.residuals == {} and psgd._q == {} and psgd.step == 2


def test_powersgd_initial_q_is_the_same_on_every_rank():
    from hybrid_ray.engine.compression.powersgd import _Matrix
    mat = _Matrix(0, 6, 5, 2)
    a = PowerSGD(2)._initial_q((1, 2), 0, mat, torch.device("cpu"))
    b = PowerSGD(2)._initial_q((1, 2), 0, mat, torch.device("cpu"))
    assert torch.equal(a, b) and a.shape == (5, 2)
    assert not torch.equal(a, PowerSGD(2)._initial_q((1, 3), 0, mat, torch.device("cpu")))


# ---- switching and residual carry -------------------------------------------------------

def test_reducer_carries_residuals_of_a_switched_away_compressor():
    reducer = GradReducer([], Topology(0, 1, torch.device("cpu")), ReduceOptions(1, overlap=False),
                          Reduction(torch.float32, TopK(0.5)))
    reducer.compressor.residuals[(0, 1)] = torch.tensor([1.0, 2.0])
    reducer.set_compression(Reduction(torch.float32, PowerSGD(2)))
    assert torch.equal(reducer.carry[(0, 1)], torch.tensor([1.0, 2.0]))
    reducer.end_step(False, 2.0)  # carried residuals follow the loss scale too
    assert torch.equal(reducer.carry[(0, 1)], torch.tensor([2.0, 4.0]))
    reducer.end_step(True, 0.5)
    assert reducer.carry == {}


def small_engine(gas: int = 2, **extra) -> Engine:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    return Engine(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), cfg,
                  topology=Topology(0, 1, torch.device("cpu")))


def micro_step(engine: Engine) -> None:
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()


def test_set_gradient_compression_validates_like_the_config():
    engine = small_engine()
    with pytest.raises(ConfigError) as info:
        engine.set_gradient_compression({"type": "topk", "topk_ratio": 2})
    assert str(info.value).startswith("gradient_compression.topk_ratio: out of range; got 2")
    with pytest.raises(ConfigError, match=r"^gradient_compression.rnak: unknown key; did you mean 'rank'"):
        engine.set_gradient_compression({"type": "powersgd", "rnak": 2})
    with pytest.raises(ConfigError, match=r"^gradient_compression.type: "):
        engine.set_gradient_compression("gzip")
    with pytest.raises(ConfigError, match=r"^gradient_compression: expected an object"):
        engine.set_gradient_compression(3)
    assert engine.gradient_compression["type"] == "none"  # a refused spec changes nothing


def test_set_gradient_compression_switches_between_steps_only():
    engine = small_engine()
    engine.set_gradient_compression({"type": "powersgd", "rank": 2, "warmup_steps": 1})
    assert engine.gradient_compression == {"type": "powersgd", "topk_ratio": 0.01, "topk_values": "fp32",
                                           "topk_indices": "int32", "rank": 2, "warmup_steps": 1,
                                           "error_feedback": True, "form": "auto", "update_bound": True,
                                           "max_quality_loss": 0.03}
    assert engine.config.gradient_compression.rank == 2
    micro_step(engine)
    with pytest.raises(RuntimeError, match="inside a gradient accumulation window"):
        engine.set_gradient_compression(None)
    micro_step(engine)
    engine.set_gradient_compression("none")
    assert engine.gradient_compression["type"] == "none" and engine.reducer.compressor is None
    engine.backward(engine(torch.randn(2, 4)).square().mean())  # a backward opens the window
    with pytest.raises(RuntimeError, match="between optimizer steps"):
        engine.set_gradient_compression("topk")


def test_half_precision_switch_sets_the_reduction_dtype():
    engine = small_engine(gas=1)
    engine.set_gradient_compression({"type": "bf16"})
    assert engine.reducer.reduce_dtype == torch.bfloat16
    engine.set_gradient_compression(None)
    assert engine.reducer.reduce_dtype == torch.float32


def test_compression_stats_time_the_step_window_on_one_rank():
    engine = small_engine()
    micro_step(engine)
    micro_step(engine)
    stats = engine.compression_stats()
    assert stats["step_s"] > 0 and stats["comm_wait_s"] == 0 and stats["compress_s"] == 0
    assert stats["bytes_sent"] == 0  # one rank: nothing is reduced


def test_probe_bandwidth_without_a_group_is_infinite():
    assert probe_bandwidth() == math.inf
