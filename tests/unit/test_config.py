"""Unit tests for hybrid_ray.config: loading, strict errors, batch resolution, round trips."""
from __future__ import annotations

import dataclasses
import json
import pickle
import re

import pytest

from hybrid_ray.config import (BatchSizes, Config, ConfigError, NotSupportedError,
                               PrecisionStep, WarmupCosineLRParams, WarmupDecayLRParams,
                               WarmupLRParams, load_config)

SEED_DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "weight_decay": 0.01}},
    "fp16": {"enabled": True, "loss_scale_window": 1000, "initial_scale_power": 16},
}
SEED_ZERO = {
    "zero_optimization": {"stage": 3, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": True, "reduce_scatter": True},
    "tensor_model_parallel_size": 4,
    "pipeline_model_parallel_size": 2,
}


# The batch size a config needs to load at all (load_config refuses a config that sets none).
MICRO = {"train_micro_batch_size_per_gpu": 1}


def error_of(source: object, cls: type = ConfigError) -> str:
    """Load `source`, expect `cls` exactly, and return its one-line message."""
    with pytest.raises(ConfigError) as info:
        load_config(source)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- the seed's configs -------------------------------------------------------------------------

def test_seed_deepspeed_config_loads_from_dict_and_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(SEED_DEEPSPEED))
    for source in (SEED_DEEPSPEED, path, str(path)):
        cfg = load_config(source)
        assert cfg.train_micro_batch_size_per_gpu == 8
        assert cfg.optimizer.type == "AdamW"
        assert cfg.optimizer.params == {"lr": 5e-5, "weight_decay": 0.01}
        assert cfg.fp16.enabled and cfg.fp16.initial_scale_power == 16
        assert cfg.base_dtype == "fp16"
        assert cfg.zero_optimization.stage == 0 and cfg.scheduler is None


def test_seed_zero_block_loads_and_splits_the_world():
    cfg = load_config({**SEED_ZERO, **MICRO})
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (4, 2)
    assert cfg.data_parallel_size(8) == 1 and cfg.data_parallel_size(16) == 2
    with pytest.raises(ConfigError, match=r"^tensor_model_parallel_size: does not fit the world size; "
                       r"got 4 \* pipeline_model_parallel_size 2 with world size 12"):
        cfg.data_parallel_size(12)


def test_seed_zero_block_values_parse():
    # Same block at a supported stage and parallel sizes: proves the keys themselves parse.
    raw = json.loads(json.dumps(SEED_ZERO))
    raw["zero_optimization"]["stage"] = 2
    raw["tensor_model_parallel_size"] = raw["pipeline_model_parallel_size"] = 1
    zero = load_config({**raw, **MICRO}).zero_optimization
    assert zero.stage == 2
    assert zero.allgather_bucket_size == 500_000_000
    assert type(zero.allgather_bucket_size) is int


def test_pipeline_section_defaults_and_the_interleaved_schedule():
    pipe = load_config(MICRO).pipeline
    assert (pipe.schedule, pipe.stages_per_rank, pipe.partition_method, pipe.micro_batches) == (
        "1f1b", 1, None, None)
    pipe = load_config({**MICRO, "pipeline": {"schedule": "interleaved_1f1b", "stages_per_rank": 2,
                                              "partition_method": "type:Block"}}).pipeline
    assert (pipe.schedule, pipe.stages_per_rank, pipe.partition_method) == ("interleaved_1f1b", 2, "type:Block")


@pytest.mark.parametrize("pipeline,match", [
    ({"schedule": "interleaved_1f1b"}, r"^pipeline\.schedule, pipeline\.stages_per_rank: contradiction; "
                                       r"got 'interleaved_1f1b' with 1"),
    ({"stages_per_rank": 2}, r"^pipeline\.schedule, pipeline\.stages_per_rank: contradiction; got '1f1b' with 2"),
    ({"stages_per_rank": 0}, r"^pipeline\.stages_per_rank: "),
    ({"schedule": "zero_bubble"}, r"^pipeline\.schedule: "),
    ({"partition_method": "balanced"}, r"^pipeline\.partition_method: unknown partition method; got 'balanced'"),
    ({"partition_method": "type:(["}, r"^pipeline\.partition_method: invalid regular expression"),
])
def test_pipeline_section_refusals_name_the_key(pipeline, match):
    assert re.search(match, error_of({**MICRO, "pipeline": pipeline}))


def test_existing_config_is_returned_as_is():
    cfg = load_config(MICRO)
    assert load_config(cfg) is cfg
    assert cfg == Config(train_micro_batch_size_per_gpu=1)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config(MICRO).fp16.enabled = True  # type: ignore[misc]


# ---- unknown keys -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, message", [
    ({"gradient_clipp1ng": 1.0},
     "gradient_clipp1ng: unknown key; did you mean 'gradient_clipping'?"),
    ({"zero_optimization": {"stagee": 1}},
     "zero_optimization.stagee: unknown key; did you mean 'stage'?"),
    ({"zero_optimization": {"offload_optimizer": {"devic": "cpu"}}},
     "zero_optimization.offload_optimizer.devic: unknown key; did you mean 'device'?"),
    ({"optimizer": {"params": {"lrr": 0.1}}},
     "optimizer.params.lrr: unknown key; did you mean 'lr'?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_l": 0.1}}},
     "scheduler.params.warmup_max_l: unknown key; did you mean 'warmup_max_lr'?"),
    ({"precision": {"schedule": [{"step": 1, "dtyp": "bf16"}]}},
     "precision.schedule[0].dtyp: unknown key; did you mean 'dtype'?"),
])
def test_unknown_key_suggests_nearest(raw, message):
    assert error_of(raw) == message


def test_unknown_key_without_close_match_lists_allowed_keys():
    message = error_of({"bf16": {"zzz": True}})
    assert message == "bf16.zzz: unknown key; allowed: enabled, immediate_grad_update"
    top = error_of({"xyzzy": 1})
    assert top.startswith("xyzzy: unknown key; allowed: train_batch_size, ")
    assert "precision" in top


def test_deepspeed_only_optimizer_param_says_what_to_do():
    # DeepSpeed's Adam with adam_w_mode true (its default) is decoupled decay: torch's AdamW.
    message = error_of({"optimizer": {"type": "Adam", "params": {"adam_w_mode": True}}})
    assert message.startswith("optimizer.params.adam_w_mode: contradiction; got true with type 'Adam'; ")
    assert "set type 'AdamW'" in message
    assert error_of({"optimizer": {"type": "SGD", "params": {"torch_adam": True}}}).startswith(
        "optimizer.params.torch_adam: unknown key; got True; ")


def test_deepspeed_adam_keys_that_mean_what_the_type_does_are_read_and_dropped():
    for kind, mode in (("AdamW", True), ("Adam", False)):
        cfg = load_config({"train_batch_size": 1, "optimizer": {
            "type": kind, "params": {"lr": 0.1, "torch_adam": True, "adam_w_mode": mode}}})
        assert cfg.optimizer.params == {"lr": 0.1}


# ---- wrong types --------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, message", [
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled: expected a boolean; got 'yes'"),
    ({"fp16": {"enabled": 1}}, "fp16.enabled: expected a boolean; got 1"),
    ({"steps_per_print": True}, "steps_per_print: expected an integer; got True"),
    ({"steps_per_print": 1.5}, "steps_per_print: expected an integer; got 1.5"),
    ({"train_batch_size": "32"}, "train_batch_size: expected an integer or null; got '32'"),
    ({"gradient_clipping": False}, "gradient_clipping: expected a number; got False"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping: expected a finite number; got nan"),
    ({"fp16": []}, "fp16: expected an object; got []; a FP16Config section"),
    ({"precision": {"schedule": {"step": 1}}},
     "precision.schedule: expected a list; got {'step': 1}"),
    ({"optimizer": {"params": {"lr": "fast"}}},
     "optimizer.params.lr: expected a number; got 'fast'"),
    ({"optimizer": {"params": {"betas": [0.9]}}},
     "optimizer.params.betas: expected a list of 2 items; got [0.9]"),
])
def test_wrong_type(raw, message):
    assert error_of(raw) == message


def test_int_accepts_integral_float_and_float_accepts_int():
    cfg = load_config({**MICRO, "zero_optimization": {"reduce_bucket_size": 5e7},
                       "gradient_clipping": 1})
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int
    assert cfg.gradient_clipping == 1.0 and type(cfg.gradient_clipping) is float


def test_null_offload_section_means_default():
    zero = load_config({**MICRO, "zero_optimization": {"offload_optimizer": None}}).zero_optimization
    assert zero.offload_optimizer == Config().zero_optimization.offload_optimizer


# ---- values out of range / not allowed ----------------------------------------------------------

@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"stage": 4}},
     "zero_optimization.stage: out of range; got 4; allowed: 0, 1, 2, 3"),
    ({"gradient_clipping": -1}, "gradient_clipping: out of range; got -1.0; allowed: >= 0"),
    ({"fp16": {"initial_scale_power": 65}},
     "fp16.initial_scale_power: out of range; got 65; allowed: >= 0 and <= 64"),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale: out of range; got 0.0; allowed: > 0"),
    ({"gradient_compression": {"topk_ratio": 1.5}},
     "gradient_compression.topk_ratio: out of range; got 1.5; allowed: > 0 and <= 1"),
    ({"train_micro_batch_size_per_gpu": 0},
     "train_micro_batch_size_per_gpu: out of range; got 0; allowed: >= 1"),
    ({"optimizer": {"params": {"betas": [0.9, 1.0]}}},
     "optimizer.params.betas[1]: out of range; got 1.0; allowed: >= 0 and < 1"),
    ({"optimizer": {"params": {"lr": -0.1}}},
     "optimizer.params.lr: out of range; got -0.1; allowed: >= 0"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device: invalid value; got 'gpu'; "
     "allowed: 'none', 'cpu', 'nvme' (did you mean 'cpu'?)"),
    ({"communication_data_type": "fp8"},
     "communication_data_type: invalid value; got 'fp8'; allowed: 'fp32', 'fp16', 'bf16'"),
    ({"optimizer": {"type": "Lamb"}},
     "optimizer.type: invalid value; got 'Lamb'; allowed: 'AdamW', 'Adam', 'SGD'"),
])
def test_out_of_range(raw, message):
    assert error_of(raw) == message


def test_fp16_and_bf16_contradict():
    assert error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == (
        "fp16.enabled, bf16.enabled: contradiction; got both true; enable at most one")


# ---- optimizer ----------------------------------------------------------------------------------

def test_optimizer_type_is_case_insensitive_and_canonical():
    cfg = load_config({**MICRO, "optimizer": {"type": "adamw", "params": {"betas": [0.9, 0.95]}}})
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["betas"] == (0.9, 0.95)
    assert load_config({**MICRO, "optimizer": {"type": "sgd"}}).optimizer.type == "SGD"


def test_sgd_does_not_require_lr_and_checks_its_own_signature():
    cfg = load_config({**MICRO, "optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})
    assert cfg.optimizer.params == {"momentum": 0.9}
    assert error_of({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}).startswith(
        "optimizer.params.betas: unknown key; ")


@pytest.mark.parametrize("name", ["fused", "foreach", "capturable", "differentiable"])
def test_implementation_params_are_chosen_by_the_engine(name):
    message = error_of({"optimizer": {"params": {name: True}}})
    assert message == (f"optimizer.params.{name}: not configurable; got True; "
                       "the engine chooses the optimizer implementation itself")


# ---- scheduler ----------------------------------------------------------------------------------

def test_scheduler_params_are_typed_by_scheduler_type():
    cfg = load_config({**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}})
    assert cfg.scheduler.params == WarmupLRParams(warmup_max_lr=1e-3)
    cfg = load_config({**MICRO, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 5000, "warmup_num_steps": 100}}})
    assert isinstance(cfg.scheduler.params, WarmupDecayLRParams)
    assert cfg.scheduler.params.warmup_type == "log"
    cfg = load_config({**MICRO, "scheduler": {"type": "warmupcosinelr",
                                              "params": {"total_num_steps": 2000}}})
    assert cfg.scheduler.type == "WarmupCosineLR"
    assert cfg.scheduler.params == WarmupCosineLRParams(total_num_steps=2000)
    assert load_config({**MICRO, "scheduler": None}).scheduler is None


def test_scheduler_errors():
    assert error_of({"scheduler": {"type": "WarmupDecayLR"}}) == (
        "scheduler.params.total_num_steps: missing required key; expected an integer")
    assert error_of({"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 500}}}) == (
        "scheduler.params.total_num_steps, scheduler.params.warmup_num_steps: contradiction; "
        "got 500 <= 1000; need total_num_steps > warmup_num_steps "
        "(warmup_num_steps defaults to 1000)")
    assert error_of({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}) == (
        "scheduler.params.warmup_type: invalid value; got 'cosine'; allowed: 'log', 'linear'")
    assert error_of({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}}) == (
        "scheduler.params.warmup_num_steps: out of range; got -1; allowed: >= 0")
    assert error_of({"scheduler": {"params": {}}}).startswith(
        "scheduler.type: missing required key; expected one of 'WarmupLR'")


# ---- precision and regexes ----------------------------------------------------------------------

def test_precision_section_loads():
    cfg = load_config({**MICRO, "bf16": {"enabled": True}, "precision": {
        "modules": {r"^lm_head$": "fp32", r"attn\..*": "fp16"},
        "schedule": [{"step": 100, "dtype": "fp16"}, {"step": 200, "dtype": "bf16"}]}})
    assert cfg.base_dtype == "bf16"
    assert cfg.precision.schedule == (PrecisionStep(step=100, dtype="fp16"),
                                      PrecisionStep(step=200, dtype="bf16"))
    assert cfg.precision.uses_fp16


def test_precision_errors():
    assert error_of({"precision": {"modules": {"enc(": "fp16"}}}) == (
        "precision.modules['enc(']: invalid regular expression; got 'enc('; "
        "a Python regex (missing ), unterminated subpattern at position 3)")
    assert error_of({"precision": {"modules": {"encoder": "fp8"}}}) == (
        "precision.modules.encoder: invalid value; got 'fp8'; allowed: 'fp32', 'fp16', 'bf16'")
    assert error_of({"precision": {"schedule": [{"step": 10, "dtype": "bf16"},
                                                {"step": 10, "dtype": "fp32"}]}}) == (
        "precision.schedule[1].step: not ascending; got 10; "
        "must be > 10 (the previous entry's step)")
    assert error_of({"precision": {"schedule": [{"step": 0, "dtype": "bf16"}]}}) == (
        "precision.schedule[0].step: out of range; got 0; allowed: >= 1")


def test_activation_checkpointing_pattern_must_compile():
    assert error_of({"activation_checkpointing": {"module_pattern": "(("}}).startswith(
        "activation_checkpointing.module_pattern: invalid regular expression; got '(('; ")


# ---- NotSupportedError --------------------------------------------------------------------------

@pytest.mark.parametrize("raw, prefix", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device: not supported yet; got 'nvme'; allowed: 'none', 'cpu'"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device: not supported yet; got 'nvme'"),
    ({"activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing.partition_activations: not supported yet; got True"),
])
def test_not_supported(raw, prefix):
    message = error_of(raw, NotSupportedError)
    assert message.startswith(prefix), message
    assert "allowed: " in message


def test_parse_errors_win_over_not_supported():
    # A typo next to an unsupported feature is reported as the typo, not as "not supported".
    assert error_of({"zero_optimization": {"stage": 3, "overlap_com": True}}) == (
        "zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?")


# ---- batch arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("given, dp, expected", [
    ({"train_micro_batch_size_per_gpu": 8}, 4, (32, 8, 1)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 4, (64, 4, 4)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4, (64, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
])
def test_resolve_batch_infers_the_missing_sizes(given, dp, expected):
    assert load_config(given).resolve_batch(dp) == BatchSizes(*expected)


def batch_error(given: dict, dp: int) -> str:
    cfg = load_config(given)
    with pytest.raises(ConfigError) as info:
        cfg.resolve_batch(dp)
    return str(info.value)


def test_resolve_batch_contradiction_names_all_three_keys():
    assert batch_error({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
                        "gradient_accumulation_steps": 2}, 4) == (
        "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: "
        "contradiction; got 32, 8, 2 with dp_size 4 (8 * 2 * 4 = 64); "
        "need train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps "
        "* dp_size")


def test_resolve_batch_non_divisible_and_missing():
    # Each loads (one rank can run it) and fails only at its dp_size; load_config refuses what
    # fails at every dp_size (test_config_rules.py).
    assert batch_error({"train_batch_size": 28, "train_micro_batch_size_per_gpu": 4}, 2) == (
        "train_batch_size, train_micro_batch_size_per_gpu: not divisible; "
        "got 28, 4 with dp_size 2; "
        "need train_batch_size divisible by train_micro_batch_size_per_gpu * dp_size = 8")
    assert batch_error({"train_batch_size": 32}, 3) == (
        "train_batch_size: not divisible; got 32 with dp_size 3; "
        "need train_batch_size divisible by dp_size = 3")
    assert batch_error({"train_batch_size": 8, "gradient_accumulation_steps": 4}, 4) == (
        "train_batch_size, gradient_accumulation_steps: not divisible; got 8, 4 with dp_size 4; "
        "need train_batch_size divisible by gradient_accumulation_steps * dp_size = 16")
    assert batch_error({"train_batch_size": 8}, 0) == (
        "dp_size: out of range; got 0; allowed: an integer >= 1")


# ---- round trips --------------------------------------------------------------------------------

FULL = {
    **SEED_DEEPSPEED,
    "optimizer": {"type": "adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10_000}},
    "gradient_clipping": 1.0,
    "communication_data_type": "bf16",
    "zero_optimization": {"stage": 2, "offload_optimizer": None},
    "seed": 1234,
    "precision": {"modules": {r"^head\.": "fp32"}, "schedule": [{"step": 5, "dtype": "fp32"}]},
}


def test_to_dict_round_trips_and_is_json():
    cfg = load_config(FULL)
    plain = cfg.to_dict()
    assert json.loads(json.dumps(plain)) == plain
    assert plain["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert load_config(plain) == cfg
    assert load_config(json.loads(json.dumps(plain))) == cfg


def test_flat_dict_joins_keys_with_dots():
    flat = load_config(FULL).flat_dict()
    assert flat["zero_optimization.stage"] == 2
    assert flat["zero_optimization.offload_optimizer.device"] == "none"
    assert flat["optimizer.params.lr"] == 3e-4
    assert flat["scheduler.params.total_num_steps"] == 10_000
    # Lists and regex-keyed dicts stay one JSON value: tracking backends reject such keys.
    assert flat["optimizer.params.betas"] == "[0.9,0.95]"
    assert json.loads(flat["precision.modules"]) == {r"^head\.": "fp32"}
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in flat.values())


# ---- files and errors ---------------------------------------------------------------------------

def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    assert error_of(path) == f"{path}: config file not found"


def test_bad_json_names_file_and_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "fp16": {"enabled": true,}\n}')
    assert error_of(str(path)) == (
        f"{path}: invalid JSON at line 2 column 28: "
        "Expecting property name enclosed in double quotes")


def test_duplicate_json_keys_are_errors(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"steps_per_print": 1, "steps_per_print": 2}')
    assert error_of(path) == f"{path}: duplicate key 'steps_per_print' in one JSON object"


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_of(path) == "<config>: expected an object; got [1, 2]; a Config section"
    # Any JSON value that is not an object, passed directly (a str is a path).
    for value in (42, None, True, 1.5, [1, 2]):
        assert error_of(value).startswith("<config>: expected an object; got ")


def test_errors_survive_pickling_with_their_path():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"offload_param": {"device": "cpu"}}})
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is NotSupportedError
    assert str(copy) == str(info.value) and copy.path == "zero_optimization.offload_param.device"


def test_long_values_are_shortened_in_messages():
    message = error_of({"fp16": {"enabled": "x" * 500}})
    assert len(message) < 120 and message.endswith("...")
