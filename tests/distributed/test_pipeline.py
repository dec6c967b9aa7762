"""A PipelineModule split into stages (torch.distributed.pipelining under the engine) trains as
one process does on the whole batch: 2 stages at data-parallel 1 and 2, GPipe, 1F1B and
interleaved 1F1B (two stages per rank), ZeRO 0 to 3, gradient clipping over the whole model, a weight tied across stages, in fp32 (relative
error ~1e-6), bf16 and fp16."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hybrid_ray as deepspeed
from hybrid_ray.config import NotSupportedError
from hybrid_ray.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]
MICRO, GAS, STEPS = 2, 4, 3


def layers():
    return [LayerSpec(nn.Linear, 6, 16), nn.Tanh(), LayerSpec(nn.Linear, 16, 16), lambda x: torch.relu(x),
            LayerSpec(nn.Linear, 16, 16), nn.Tanh(), LayerSpec(nn.Linear, 16, 3)]


PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


def config(dp: int, zero: int, schedule: str, precision: str = "fp32") -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO * (2 // dp), "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            # at ZeRO-3 parameters above 100 elements are partitioned (the default threshold
            # would keep every weight of these small models whole, and test nothing of it)
            "zero_optimization": {"stage": zero, **({"stage3_param_persistence_threshold": 100} if zero == 3 else {})},
            "pipeline": {"schedule": schedule, "stages_per_rank": per_rank(schedule)},
            **PRECISION[precision]}


def per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def micro_batches(step: int, dp: int, dp_rank: int, count: int = GAS, samples: int = 2 * MICRO):
    """The step's `count` micro-batches of `samples` samples (6 features, 3 classes), this
    replica's part of each: the same batch at every data-parallel size."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(count):
        x, y = torch.randn(samples, 6, generator=g), torch.randint(0, 3, (samples,), generator=g)
        n = samples // dp
        out.append((x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]))
    return out


def train(model: PipelineModule, dp: int, dp_rank: int, zero: int, schedule: str, precision: str = "fp32"):
    engine = deepspeed.initialize(model=model, config=config(dp, zero, schedule, precision))[0]
    losses = [engine.train_batch(iter(micro_batches(s, dp, dp_rank))).item() for s in range(STEPS)]
    return engine, losses


def staged(rank: int, world: int, out: str, zero: int, schedule: str, precision: str) -> None:
    model = PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2, seed_layers=True,
                           stages_per_rank=per_rank(schedule))
    assert len(model.virtual_stages) == per_rank(schedule)
    layout = model.pipe_layout
    engine, losses = train(model, layout.dp_size, layout.dp_rank, zero, schedule, precision)
    assert engine.is_pipe_parallel() and engine.is_first_stage() == (layout.stage == 0)
    steps = engine.global_steps
    losses.append(engine.eval_batch(iter(micro_batches(STEPS, layout.dp_size, layout.dp_rank))).item())
    assert engine.global_steps == steps and engine.module.training
    dump(engine, losses, out, rank)


def dump(engine, losses, out: str, rank: int) -> None:
    """This rank's losses and stage weights, for the test process to compare; the engine ends."""
    state = {k: v.tolist() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "state": state}))
    engine.destroy()


def assert_like_one_process(out: Path, world: int, want_state: dict, want_losses: list,
                            rtol: float, atol: float, loss_tol: dict) -> list:
    """Every rank reports the one-process losses; copies of a weight (a stage's replicas, a
    tie's stages) are bitwise equal; together the stages hold the one-process weights."""
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for g in got:  # every stage of every replica reports the pipeline's loss
        assert g["losses"] == pytest.approx(want_losses, **loss_tol)
    merged = {}
    for g in got:
        for k, v in g["state"].items():
            if k in merged:
                torch.testing.assert_close(torch.tensor(v), merged[k], rtol=0, atol=0)
            merged[k] = torch.tensor(v)
    assert sorted(merged) == sorted(want_state)
    for k, v in want_state.items():
        torch.testing.assert_close(merged[k], v.float(), rtol=rtol, atol=atol)
    return got


def reference(precision: str):
    model = PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), seed_layers=True)
    engine, losses = train(model, 1, 0, 0, "1f1b", precision)
    losses.append(engine.eval_batch(iter(micro_batches(STEPS, 1, 0))).item())
    return {k: v.float() for k, v in engine.module.state_dict().items()}, losses


# fp32 to rounding; in bf16/fp16 the activations cross the stage boundary in fp32, which the
# one-process run keeps in half precision: equal to half precision's rounding.
TOL = {"fp32": (1e-5, 1e-6), "bf16": (3e-2, 3e-2), "fp16": (5e-3, 5e-3)}


@pytest.mark.parametrize("world,zero,schedule,precision", [
    (2, 0, "1f1b", "fp32"), (2, 1, "gpipe", "fp32"), (4, 1, "1f1b", "fp32"), (4, 2, "gpipe", "fp32"),
    (2, 2, "1f1b", "fp32"), (2, 1, "1f1b", "bf16"), (2, 0, "gpipe", "fp16"), (4, 2, "1f1b", "fp16"),
    (4, 3, "1f1b", "fp32"), (4, 3, "gpipe", "bf16"), (2, 1, "interleaved_1f1b", "fp32"),
    (4, 3, "interleaved_1f1b", "bf16")])
def test_stages_train_as_one_process(tmp_path: Path, world: int, zero: int, schedule: str, precision: str) -> None:
    spawn.run(staged, world, str(tmp_path), zero, schedule, precision, timeout_s=60)
    want_state, want_losses = reference(precision)
    rtol, atol = TOL[precision]
    assert_like_one_process(tmp_path, world, want_state, want_losses, rtol, atol, {"rel": rtol, "abs": atol})


def tied_layers():
    """An input projection whose transpose is the last stage's output projection, as GPT ties
    its embedding and head: with uniform partition the two uses fall in different stages."""
    return [TiedLayerSpec("proj", nn.Linear, 6, 16, bias=False), nn.Tanh(), LayerSpec(nn.Linear, 16, 16),
            nn.Tanh(), TiedLayerSpec("proj", nn.Linear, 6, 16, bias=False, forward_fn=lambda m, x: x @ m.weight),
            LayerSpec(nn.Linear, 6, 3)]


def tied(rank: int, world: int, out: str) -> None:
    model = PipelineModule(layers=tied_layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                           partition_method="uniform", seed_layers=True)
    assert list(model.tie_groups) == ["proj"] and model.parts == [0, 3, 6]
    layout = model.pipe_layout
    engine, losses = train(model, layout.dp_size, layout.dp_rank, 1, "1f1b")
    dump(engine, losses, out, rank)


def test_a_weight_tied_across_stages_trains_as_one_weight(tmp_path: Path) -> None:
    # its two stages hold one copy each: gradients summed over both, counted once in the norm
    # (clipping at 0.3 is active), so both copies stay equal to the one-process weight
    spawn.run(tied, 2, str(tmp_path), timeout_s=60)
    model = PipelineModule(layers=tied_layers(), loss_fn=nn.CrossEntropyLoss(), seed_layers=True)
    engine, want_losses = train(model, 1, 0, 1, "1f1b")
    got = assert_like_one_process(tmp_path, 2, engine.module.state_dict(), want_losses, 1e-5, 1e-6, {"rel": 1e-5})
    assert "tied_modules.proj.weight" in got[0]["state"] and "tied_modules.proj.weight" in got[1]["state"]


def refusals(rank: int, world: int) -> None:
    model = PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    engine = deepspeed.initialize(model=model, config=config(1, 1, "1f1b"))[0]
    with pytest.raises(NotSupportedError, match="trains through engine.train_batch"):
        engine(torch.randn(2, 6))
    engine.destroy()


def test_what_stages_do_not_do_yet_is_refused() -> None:
    spawn.run(refusals, 2, timeout_s=60)


def gpt_config():
    # Without biases: the attention key's bias has a gradient that is zero up to rounding (the
    # softmax ignores it), which AdamW turns into steps of either sign, differently in any two
    # summation orders; every other weight is compared to rounding.
    import dataclasses

    from hybrid_ray.models.gpt import GPT_SIZES

    return dataclasses.replace(GPT_SIZES["tiny"], bias=False)


def gpt_micro_batches(step: int, dp: int, dp_rank: int):
    cfg = gpt_config()
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(GAS):
        tokens = torch.randint(0, cfg.vocab_size, (2 * MICRO, cfg.seq_len + 1), generator=g)
        n = 2 * MICRO // dp
        part = tokens[dp_rank * n:(dp_rank + 1) * n]
        out.append((part[:, :-1], part[:, 1:]))
    return out


def gpt_run(num_stages: int, dp: int, dp_rank: int, zero: int = 1, schedule: str = "1f1b", **pipe):
    """`pipe`: the config's pipeline keys besides the schedule (num_stages None: the config's
    pipeline_model_parallel_size cuts the model)."""
    from hybrid_ray.lm.pipeline_model import gpt_pipeline

    cut_by_config = num_stages is None
    model = gpt_pipeline(gpt_config(), num_stages, seed_layers=True,
                         **({} if cut_by_config else {"stages_per_rank": per_rank(schedule)}))
    cfg = config(dp, zero, schedule)
    cfg["pipeline"].update(pipe)
    if cut_by_config:
        cfg["pipeline_model_parallel_size"] = 2
    # AdamW's eps at 1e-5: at 1e-8 an embedding row whose gradient cancels to ~1e-8 (a token
    # the batch barely uses) turns rounding-level differences of two summation orders (dp 2
    # against one process) into weights 3e-5 apart on some CPUs.
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-5}}
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    losses = [engine.train_batch(iter(gpt_micro_batches(s, dp, dp_rank))).item() for s in range(STEPS)]
    return engine, losses


def gpt_staged(rank: int, world: int, out: str, zero: int, schedule: str, cut_by_config: bool) -> None:
    pipe = {"partition_method": "uniform"} if cut_by_config else {}
    engine, losses = gpt_run(None if cut_by_config else 2, world // 2, rank % (world // 2), zero, schedule, **pipe)
    module = engine.module
    assert "embed" in module.tie_groups  # embedding on (rank) stage 0, head on stage 1
    if cut_by_config:  # 5 layers in 4 stages of 1 or 2 layers: rank 0 holds stages 0 and 2
        assert module.parts == [0, 1, 2, 4, 5] and module.partition_method == "uniform"
        assert module.chunk_bounds() == ([(0, 1), (2, 4)] if module.stage_id == 0 else [(1, 2), (4, 5)])
    dump(engine, losses, out, rank)


def gpt_one_stage(rank: int, world: int, out: str) -> None:
    engine, losses = gpt_run(1, world, rank, zero=3)
    dump(engine, losses, out, rank)


def test_the_project_gpt_as_one_stage_at_zero3_trains_as_one_process(tmp_path: Path) -> None:
    """P = 1 over 2 data-parallel ranks at ZeRO-3: the embedding, its tied head and the blocks
    partitioned (the layouts (1, 1, dp) and (T, 1, dp) run the GPT so)."""
    spawn.run(gpt_one_stage, 2, str(tmp_path), timeout_s=90)
    engine, want_losses = gpt_run(1, 1, 0)
    assert_like_one_process(tmp_path, 2, engine.module.state_dict(), want_losses, 1e-4, 1e-5, {"rel": 1e-5})


@pytest.mark.parametrize("world,zero,schedule,cut_by_config", [
    (2, 1, "1f1b", False), (4, 2, "1f1b", False), (4, 3, "1f1b", False),
    (2, 1, "interleaved_1f1b", False), (4, 2, "interleaved_1f1b", True)])
def test_the_project_gpt_in_two_stages_trains_as_one_process(tmp_path: Path, world: int, zero: int,
                                                             schedule: str, cut_by_config: bool) -> None:
    spawn.run(gpt_staged, world, str(tmp_path), zero, schedule, cut_by_config, timeout_s=90)
    engine, want_losses = gpt_run(1, 1, 0)
    # dp 2 sums in another order: AdamW moves the weights ~1e-6 apart
    assert_like_one_process(tmp_path, world, engine.module.state_dict(), want_losses, 1e-4, 1e-5, {"rel": 1e-5})
