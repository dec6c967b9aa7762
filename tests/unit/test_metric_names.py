"""The LM job's MLflow metric names: grouped by prefix, constant series left out, at least 100
points of each series per run by default, about 20 console lines."""
from __future__ import annotations

import copy

from hybrid_ray.lm.job import console_interval, load_job
from hybrid_ray.lm.metric_names import NAMES, MetricNames, mlflow_name, short_name
from tests.unit.test_lm_job import TINY

STEP = {"step": 10, "train_loss": 2.5, "lr": 1e-3, "loss_scale": 1.0, "grad_norm": 0.7,
        "tokens_per_s": 900.0, "skipped_steps": 0, "grad_bytes_sent": 4096, "compression_ratio": 1.0,
        "compress_s": 0.0, "step_s": 0.2, "comm_wait_s": 0.01, "world_size": 2, "val_step": 8}


def job(**engine):
    raw = copy.deepcopy(TINY)
    raw["engine"].update(engine)
    return load_job(raw)


def test_every_name_has_a_prefix_by_concern():
    prefixes = {full.split("/")[0] for full in NAMES.values()}
    assert prefixes == {"train", "val", "perf", "comm", "elastic", "final"}
    assert mlflow_name("train_loss") == "train/loss" and mlflow_name("val_loss") == "val/loss"
    assert mlflow_name("system/cpu") == "system/cpu" and mlflow_name("mine") == "mine"
    assert short_name("perf/tokens_per_s") == "tokens_per_s" and short_name("x/y") is None


def test_a_dense_bf16_run_on_a_fixed_group_logs_only_what_moves():
    names = MetricNames.for_job(job(bf16={"enabled": True}), fixed_world=True)
    logged = names(STEP)
    assert logged == {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.7,
                      "perf/tokens_per_s": 900.0, "train/skipped_steps": 0.0,
                      "comm/step_s": 0.2, "comm/wait_s": 0.01}


def test_fp16_compression_and_an_elastic_group_keep_their_series():
    engine = dict(fp16={"enabled": True}, bf16={"enabled": False},
                  gradient_compression={"type": "topk", "topk_ratio": 0.1})
    logged = MetricNames.for_job(job(**engine), fixed_world=False)(STEP)
    assert {"train/loss_scale", "comm/compression_ratio", "comm/compress_s",
            "comm/grad_bytes_sent", "elastic/world_size"} <= set(logged)


def test_without_steps_per_print_a_job_logs_100_points_and_prints_about_20_lines():
    raw = copy.deepcopy(TINY)
    raw["engine"].pop("steps_per_print", None)
    raw["train"]["steps"] = 600
    if "scheduler" in raw["engine"]:
        raw["engine"]["scheduler"]["params"]["total_num_steps"] = 600
    j = load_job(raw)
    assert j.engine.steps_per_print == 6 and 600 // j.engine.steps_per_print >= 100
    assert console_interval(j) == 30
    raw["engine"]["steps_per_print"] = 7  # the job file's own choice stands
    assert load_job(raw).engine.steps_per_print == 7
    small = load_job("jobs/configs/small_cpu.json")
    assert small.train.steps // small.engine.steps_per_print >= 100
