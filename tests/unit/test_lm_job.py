"""The LM job: strict job file, the batch rule per world size, a tiny single-process run that
learns, and checkpoint + resume that continues exactly where an uninterrupted run would be."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hybrid_ray.cluster.records import Metrics
from hybrid_ray.config import BatchSizes, ConfigError, NotSupportedError
from hybrid_ray.lm.job import for_world, load_job
from hybrid_ray.lm.setup import RunContext

TINY = {
    "engine": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
               "seed": 0, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
               "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32},
    "data": {"path": "<set by tiny_job>",
             "corpus": {"tokenizer": "bytes", "max_bytes": 150_000, "shard_tokens": 20_000}},
    "train": {"steps": 40, "eval_interval": 20, "eval_samples": 16, "sample_tokens": 20,
              "require_below_baseline": False},
}


def tiny_job(data_dir: Path, out_dir: Path = None, **train: object) -> dict:
    """TINY with its dataset (prepared on first use) and run folder under the test's tmp dirs."""
    job = copy.deepcopy(TINY)
    job["data"]["path"] = str(data_dir)
    job["train"].update(train)
    if out_dir is not None:
        job["train"]["out_dir"] = str(out_dir)
    return job


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_data") / "stdlib-bytes"


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


ENGINE = {"train_batch_size": 8}  # the least an engine section needs to load


def test_job_file_errors_name_the_section():
    with pytest.raises(ConfigError, match=r"^train.steps: missing required key"):
        load_job({"engine": ENGINE, "train": {}, "data": {"path": "x"}})
    with pytest.raises(ConfigError, match=r"^egnine: unknown key; did you mean 'engine'\?"):
        load_job({"engine": ENGINE, "egnine": {}, "train": {"steps": 1}})
    with pytest.raises(NotSupportedError,
                       match=r"^\[engine\] activation_checkpointing.partition_activations"):
        load_job({"engine": {"activation_checkpointing": {"partition_activations": True}},
                  "train": {"steps": 1}})
    with pytest.raises(ConfigError, match=r"^engine: missing required section"):
        load_job({"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match=r"^data: missing required section"):
        load_job({"engine": ENGINE, "train": {"steps": 1}})
    with pytest.raises(ConfigError, match=r"^data.path: missing required key"):
        load_job({"engine": ENGINE, "train": {"steps": 1}, "data": {}})
    with pytest.raises(ConfigError, match=r"^data.corpus.max_bytes: out of range; got 5"):
        load_job({"engine": ENGINE, "train": {"steps": 1}, "data": {"path": "x", "corpus": {"max_bytes": 5}}})


def test_shipped_configs_are_valid():
    configs = Path(__file__).resolve().parents[2] / "jobs" / "configs"
    for path in sorted(configs.glob("*.json")):
        job = load_job(path)
        assert job.engine.train_batch_size, f"{path.name}: set train_batch_size (resizable runs)"


def test_for_world_keeps_the_global_batch():
    job = load_job(tiny_job(Path("unused")))
    sizes = {w: for_world(job, w).engine.resolve_batch(w) for w in (1, 2, 4, 8, 16)}
    assert {w: (s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps)
            for w, s in sizes.items()} == {1: (16, 8, 2), 2: (16, 8, 1), 4: (16, 4, 1),
                                          8: (16, 2, 1), 16: (16, 1, 1)}
    with pytest.raises(ConfigError, match=r"^engine.train_batch_size: train_batch_size 16 is not "
                                          r"divisible by 3 data-parallel ranks"):
        for_world(job, 3)


@pytest.mark.slow
def test_tiny_single_process_run_learns(data_dir, tmp_path, capsys):
    from hybrid_ray.lm.loop import train

    result = train(load_job(tiny_job(data_dir, tmp_path / "run")))
    out = capsys.readouterr().out
    assert "step    40/40" in out and "eval  step 20" in out and "final: train loss" in out
    assert "bytes tokenizer, vocabulary 257" in out
    assert (tmp_path / "run" / "checkpoints" / "global_step40").is_dir()
    assert result.steps == 40 and len(result.sample) >= 10
    # From ln(257) = 5.55 at initialisation to well below: the loop, engine and data fit together.
    assert result.val_loss < 4.0 and result.train_loss < 4.0
    assert 2.5 < result.unigram_nats < 4.5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [10, 20, 30, 40]
    assert [r["step"] for r in records if "val_loss" in r] == [20]
    assert records[-1]["final_val_loss"] == result.val_loss


@pytest.mark.slow
def test_resume_continues_like_an_uninterrupted_run(data_dir, tmp_path):
    from hybrid_ray.lm.loop import train

    whole = train(load_job(tiny_job(data_dir, tmp_path / "whole", steps=30, sample_tokens=0)))
    seen = []
    first = train(load_job(tiny_job(data_dir, tmp_path / "split", steps=20, sample_tokens=0)))
    second = train(load_job(tiny_job(data_dir, tmp_path / "split", steps=30, sample_tokens=0)),
                   RunContext(resume=True, report=seen.append))
    assert first.steps == 20 and second.steps == 30
    # Weights, optimizer, data position and RNG all continue: the same numbers as one run.
    assert second.val_loss == whole.val_loss and second.train_loss == whole.train_loss
    # report gets every record the run sends (cluster.records); the steps' metrics among them
    assert [r["step"] for r in seen if isinstance(r, Metrics) and "train_loss" in r] == [30]
    ckpts = sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["global_step20", "global_step30"]


def test_resume_needs_an_out_dir(data_dir):
    from hybrid_ray.lm.loop import train

    with pytest.raises(ValueError, match="--resume: train.out_dir is null"):
        train(load_job(tiny_job(data_dir, steps=1)), RunContext(resume=True))


def test_tracking_section():
    job = load_job({**TINY, "tracking": {"uri": "http://mlflow.internal:5000", "experiment": "lm"}})
    assert (job.tracking.uri, job.tracking.experiment) == ("http://mlflow.internal:5000", "lm")
    assert load_job(TINY).tracking.uri is None
    with pytest.raises(ConfigError, match=r"^tracking.url: unknown key"):
        load_job({**TINY, "tracking": {"url": "x"}})


def test_steps_shortens_a_run_in_one_flag():
    from hybrid_ray.config.api import read_json

    raw = read_json(Path(__file__).resolve().parents[2] / "jobs" / "configs" / "small_cpu.json")
    with pytest.raises(ConfigError, match="contradiction"):  # what --set train.steps=20 meets
        load_job(raw, ["train.steps=20"])
    job = load_job(raw, steps=20)
    params = job.engine.scheduler.params
    assert job.train.steps == params.total_num_steps == 20
    assert params.warmup_num_steps == 2  # 50 of 600 steps, scaled: the schedule keeps its shape
    assert load_job(raw, steps=1).engine.scheduler.params.warmup_num_steps == 0  # < total
    assert load_job(raw, ["train.eval_interval=5"], steps=30).train.eval_interval == 5  # --set stands
    short = load_job(raw, steps=30).train  # the run keeps its shape: 3 evaluations, 3 checkpoints
    assert (short.eval_interval, short.save_interval) == (10, 10)
    longer = load_job(raw, steps=1200).train
    assert (longer.eval_interval, longer.save_interval) == (200, 200)
    with pytest.raises(ConfigError, match=r"^--steps: out of range; got 0"):
        load_job(raw, steps=0)


def test_steps_flag_runs_that_many_steps(data_dir, tmp_path, capsys):
    from hybrid_ray.lm.launch import main

    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(tiny_job(data_dir, tmp_path / "run", sample_tokens=0)))
    assert main(["--config", str(cfg), "--nproc", "1", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 steps" in out and "step     4/4" in out
    assert (tmp_path / "run" / "checkpoints" / "global_step4").is_dir()


def test_resuming_a_finished_run_says_it_is_complete(data_dir, tmp_path, capsys):
    from hybrid_ray.lm.loop import train

    raw = tiny_job(data_dir, tmp_path / "run", steps=4, sample_tokens=0)
    first = train(load_job(raw))
    capsys.readouterr()
    again = train(load_job(raw), RunContext(resume=True))
    out = capsys.readouterr().out
    assert "at step 4: the run is already complete (train.steps 4); nothing to train" in out
    assert "final: no step in this run | val loss" in out and "nan" not in out and "tok/s" not in out
    assert again.steps == 4 and again.val_loss == first.val_loss


def test_job_engine_batch_is_checked_by_the_job_rule_at_load():
    # No batch size at all: no world size can run it, refused before anything starts.
    with pytest.raises(ConfigError, match=r"^\[engine\] train_batch_size, "
                                          r"train_micro_batch_size_per_gpu: missing"):
        load_job({**TINY, "engine": {"steps_per_print": 1}})
    # The micro-batch is an upper bound under the job's rule (for_world): 30 with 16 runs as
    # 2 x 15 on one rank, though a plain engine config would need 30 divisible by 16.
    job = load_job({**TINY, "engine": {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 16}})
    assert for_world(job, 1).engine.resolve_batch(1) == BatchSizes(30, 15, 2)


def test_a_warm_spares_model_is_the_one_the_run_builds(data_dir, tmp_path):
    # LMTrainFn.warm on a spare builds the job's model ahead; the run that the spare joins takes
    # it instead of building another, and only for the same model, vocabulary and seed.
    import torch

    from hybrid_ray.cluster.context import warmed
    from hybrid_ray.data import ensure_prepared
    from hybrid_ray.engine import Topology
    from hybrid_ray.lm.setup import build, warm_model

    job = load_job(tiny_job(data_dir, tmp_path / "run"))
    meta = ensure_prepared(job.data.corpus, job.data.path, job.data.prepare)
    warm_model(job)
    spare = warmed()["lm_model"][1]
    run = build(job, Topology(0, 1, torch.device("cpu")), meta)
    assert run.engine.module is spare and "lm_model" not in warmed()
    fresh = build(job, Topology(0, 1, torch.device("cpu")), meta)  # nothing warmed: built anew, equal
    for a, b in zip(run.engine.module.parameters(), fresh.engine.module.parameters()):
        assert torch.equal(a, b)
    other = load_job({**tiny_job(data_dir, tmp_path / "run"), "model": {**TINY["model"], "d_model": 64}})
    warm_model(other)
    stale = warmed()["lm_model"][1]
    assert build(job, Topology(0, 1, torch.device("cpu")), meta).engine.module is not stale
    warmed().clear()
