"""The job file of the language-model job: engine config plus model, data and run settings.

    {"engine": {...DeepSpeed-style config...}, "model": {...}, "data": {...}, "train": {...}}

The engine rejects unknown keys, so the model, data and run settings cannot live in its config;
they sit in their own sections, which are just as strict (same loader, same one-line errors). The
`engine` section is passed to `hybrid_ray.initialize` (with the batch split for the world size,
see `for_world`).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from hybrid_ray.config import Config, ConfigError, load_config
from hybrid_ray.config.api import read_json
from hybrid_ray.config.bounds import check_bounds
from hybrid_ray.config.errors import Verbatim, config_error, unknown_key_error
from hybrid_ray.config.loader import checked, load_dataclass
from hybrid_ray.data.corpus import CorpusSpec
from hybrid_ray.data.sampler import split_global_batch

SECTIONS = ("engine", "model", "data", "train", "tracking")


@dataclass(frozen=True)
class ModelSection:
    """Shape of the GPT; the vocabulary comes from the dataset's tokenizer."""

    n_layer: int = checked(4, ge=1)
    """Transformer blocks."""
    n_head: int = checked(4, ge=1)
    """Attention heads per block; must divide d_model."""
    d_model: int = checked(128, ge=1)
    """Width of the residual stream."""
    seq_len: int = checked(128, ge=2)
    """Context length in tokens (a training window is seq_len + 1 tokens)."""
    dropout: float = checked(0.0, ge=0, lt=1)
    """Dropout in attention (0 for short runs: nothing to regularise yet)."""
    vocab_multiple: int = checked(64, ge=1)
    """Round the embedding up to a multiple of this (GPU matmuls like multiples of 64)."""

    def validate(self, path: str) -> None:
        if self.d_model % self.n_head:
            raise config_error(f"{path}.d_model, {path}.n_head", "not divisible",
                               Verbatim(f"{self.d_model}, {self.n_head}"),
                               "need d_model divisible by n_head")


@dataclass(frozen=True)
class DataSection:
    """Where the token dataset lives and how it is built when missing."""

    path: str = checked()
    """Prepared dataset: a folder (relative to the working directory) or a pyarrow.fs URI."""
    prepare: bool = True
    """Build the dataset from `corpus` when `path` holds none (jobs/prepare_data.py does the same)."""
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    """Source folder, tokenizer, size cap and validation share (hybrid_ray/data/corpus.py)."""
    cache_dir: Optional[str] = None
    """Local copies of remote shards; null means ~/.cache/hybrid_ray/shards."""


@dataclass(frozen=True)
class TrainSection:
    """Length of the run, evaluation, checkpoints and the closing sample."""

    steps: int = checked(ge=1)
    """Optimizer steps (required); a scheduler's total_num_steps must equal it."""
    eval_interval: int = checked(100, ge=1)
    """Evaluate validation loss every this many steps (and always at the end)."""
    eval_samples: Optional[int] = checked(256, ge=1)
    """Validation windows in periodic evaluations; null means all. The final one uses all."""
    out_dir: Optional[str] = None
    """Run folder: checkpoints/ and metrics.jsonl; null writes neither (and cannot resume).
    On the command line the run folder is `<storage>/<run name>` (hybrid_ray/lm/placement.py)."""
    storage: Optional[str] = None
    """Parent folder of the run folder (a local path or a pyarrow.fs URI such as
    s3://bucket/runs), replacing out_dir's parent; --storage overrides it. Required as an
    absolute path or URI under `ray job submit --working-dir`, whose working directory is a
    temporary copy."""
    save_interval: Optional[int] = checked(None, ge=1)
    """Checkpoint every this many steps (and at the end) when out_dir is set; null: end only."""
    sample_tokens: int = checked(100, ge=0)
    """Tokens generated from the trained model at the end; 0 skips the sample."""
    sample_prompt: str = "def "
    """Text the sample starts from."""
    temperature: float = checked(0.8, ge=0)
    """Sampling temperature; 0 means greedy."""
    require_below_baseline: bool = True
    """Fail the run if the final validation loss is not below the unigram baseline."""


@dataclass(frozen=True)
class TrackingSection:
    """Where the run is recorded in MLflow: by the Ray driver, or by rank 0 under torchrun."""

    uri: Optional[str] = None
    """Tracking URI (e.g. http://mlflow.internal:5000); null: MLFLOW_TRACKING_URI, else
    sqlite:///mlflow.db in the working directory of the driver (or of rank 0)."""
    experiment: str = "hybrid_ray"
    """MLflow experiment; the run inside it is named after the run name."""
    enabled: bool = True
    """false: record nothing in MLflow (metrics.jsonl in train.out_dir is still written)."""


@dataclass(frozen=True)
class Job:
    """A validated job file."""

    engine: Config
    data: DataSection
    train: TrainSection
    model: ModelSection = field(default_factory=ModelSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    path: str = ""
    """The file it came from ('' for a dict)."""


def is_job_file(raw: Any) -> bool:
    """A job file has an `engine` section; a plain engine config never has that key."""
    return isinstance(raw, Mapping) and "engine" in raw


def load_job(source: Union[str, os.PathLike, Mapping[str, Any]],
             overrides: Sequence[str] = (), steps: Optional[int] = None) -> Job:
    """Load and validate a job file (path or dict), with `steps` applied first (see
    with_steps), then the `KEY.PATH=VALUE` overrides (see apply_overrides: a value set there
    stands as given); every error is one-line ConfigError."""
    path = "" if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else read_json(Path(source))
    check_bounds(raw)  # before any copy: deepcopy of a dict nested thousands deep overflows
    if steps is not None:
        raw = with_steps(raw, steps)
    if overrides:
        raw = apply_overrides(raw, overrides)
        check_bounds(raw)
    if not isinstance(raw, Mapping):
        raise config_error("", "expected an object", raw, "sections: " + ", ".join(SECTIONS))
    if not is_job_file(raw):
        raise config_error("engine", "missing required section", allowed=(
            "a job file holds {\"engine\": {...engine config...}, \"model\": {...}, \"data\": "
            "{...}, \"train\": {...}}; see jobs/configs/small_cpu.json"))
    for key in raw:
        if key not in SECTIONS:
            raise unknown_key_error("", key, SECTIONS)
    # Sections in the order of the file's usual layout, so the first error reported is the
    # first one a reader meets.
    engine = _load_engine(_with_log_interval(raw["engine"], raw.get("train")))
    model = load_dataclass(ModelSection, raw.get("model", {}), "model")
    train = load_dataclass(TrainSection, _required(raw, "train"), "train")
    _check_schedule(engine, train)
    data = load_dataclass(DataSection, _required(raw, "data"), "data")
    tracking = load_dataclass(TrackingSection, raw.get("tracking", {}), "tracking")
    return Job(engine, data, train, model, tracking, path)


def apply_overrides(raw: Any, overrides: Sequence[str]) -> dict:
    """A copy of raw with each `a.b.c=VALUE` set; VALUE is JSON (`true`, `3e-4`, `{"x": 1}`) or,
    if it does not parse, a string. Missing sections are created; the result is validated like
    any job file, so a misspelt key is still an error that names it."""
    out = copy.deepcopy(dict(raw)) if isinstance(raw, Mapping) else {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not k for k in key.split(".")):
            raise config_error("--set", "expected KEY.PATH=VALUE", item)
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, a 5000-digit int, nested too deeply
            value = text
        *parents, last = key.split(".")
        node = out
        for name in parents:
            if not isinstance(node.get(name, {}), dict):
                raise config_error(key, "cannot set inside a non-object", node[name])
            node = node.setdefault(name, {})
        node[last] = value
    return out


def with_steps(raw: Any, steps: int) -> dict:
    """A copy of raw that runs `steps` optimizer steps: train.steps, and the learning-rate
    schedule's total_num_steps and warmup_num_steps scaled to keep the schedule's shape (the
    warm-up at least one step, and shorter than the run, which a decay schedule needs), so one
    flag shortens a run. Evaluation and checkpoint intervals shrink with a shorter run (a
    600-step run saving every 200 steps saves every 10 at --steps 30); a longer run keeps them."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise config_error("--steps", "out of range", steps, "allowed: an integer >= 1")
    out = copy.deepcopy(dict(raw)) if isinstance(raw, Mapping) else {}
    train = out.setdefault("train", {})
    if not isinstance(train, dict):
        raise config_error("train", "cannot set inside a non-object", train)
    before, train["steps"] = train.get("steps"), steps
    _scale_intervals(train, before, steps)
    engine = out.get("engine")
    scheduler = engine.get("scheduler") if isinstance(engine, dict) else None
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    if not isinstance(params, dict):
        return out
    scale = steps / before if isinstance(before, int) and before > 0 else 1.0
    if "total_num_steps" in params:
        params["total_num_steps"] = steps
    if isinstance(params.get("warmup_num_steps"), int):
        params["warmup_num_steps"] = min(steps - 1, max(1, round(params["warmup_num_steps"] * scale)))
    return out


def console_interval(job: Job) -> int:
    """Steps between progress lines: about 20 lines a run, at steps the job logs (every
    engine.steps_per_print, which MLflow gets every one of)."""
    every = max(1, job.engine.steps_per_print)
    return max(every, round(job.train.steps / 20 / every) * every)


def _scale_intervals(train: dict, before: Any, steps: int) -> None:
    if not isinstance(before, int) or isinstance(before, bool) or not 0 < steps < before:
        return
    for key in ("eval_interval", "save_interval"):
        value = train.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            train[key] = max(1, round(value * steps / before))


def _required(raw: Mapping[str, Any], key: str) -> Any:
    if key not in raw:
        raise config_error(key, "missing required section",
                           allowed="a job file needs 'engine', 'data' and 'train' ('model' is optional)")
    return raw[key]


def for_world(job: Job, world: int) -> Job:
    """The job with its batch split for `world` processes (world / (tensor * pipeline)
    data-parallel ranks).

    With `train_batch_size` set, the global batch is the constant of the run: the micro-batch
    and accumulation steps are recomputed for the world size (split_global_batch's rule), so a
    job resumed on another number of ranks takes the same optimizer steps over the same sample
    stream. Without it the DeepSpeed rule applies (global batch = micro x accumulation x world).
    Raises ConfigError naming the keys when the world size cannot carry the batch.
    """
    cfg = job.engine
    try:  # world processes hold world / (tensor * pipeline) data-parallel replicas
        world = cfg.data_parallel_size(world)
    except ConfigError as exc:
        raise type(exc)(f"[engine] {exc}", f"engine.{exc.path}") from None
    if cfg.train_batch_size is not None:
        micro = cfg.train_micro_batch_size_per_gpu or cfg.train_batch_size
        try:
            sizes = split_global_batch(cfg.train_batch_size, world, micro)
        except ValueError as exc:
            raise ConfigError(f"engine.train_batch_size: {exc}", "engine.train_batch_size") from None
        cfg = dataclasses.replace(cfg, train_micro_batch_size_per_gpu=sizes.micro_batch_size,
                                  gradient_accumulation_steps=sizes.gradient_accumulation_steps)
    try:
        cfg.resolve_batch(world)
    except ConfigError as exc:
        raise type(exc)(f"[engine] {exc}", f"engine.{exc.path}") from None
    return dataclasses.replace(job, engine=cfg)


def _with_log_interval(engine: Any, train: Any) -> Any:
    """Without its own steps_per_print, a job logs about 100 points of every series per run."""
    steps = train.get("steps") if isinstance(train, Mapping) else None
    if not isinstance(engine, Mapping) or "steps_per_print" in engine or \
            not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return engine
    return {**engine, "steps_per_print": max(1, steps // 100)}


def _load_engine(raw: Any) -> Config:
    # The engine's messages name paths inside its own config; say which section they are in.
    try:
        return load_config(raw, fixed_global_batch=True)  # for_world's batch rule
    except ConfigError as exc:
        raise type(exc)(f"[engine] {exc}", f"engine.{exc.path}" if exc.path else "engine") from None


def _check_schedule(engine: Config, train: TrainSection) -> None:
    """A schedule that ends before or after the run is almost always a forgotten edit."""
    total = getattr(engine.scheduler.params, "total_num_steps", None) if engine.scheduler else None
    if total is not None and total != train.steps:
        raise config_error("engine.scheduler.params.total_num_steps, train.steps", "contradiction",
                           Verbatim(f"{total}, {train.steps}"),
                           "make them equal: the learning-rate schedule should end with the run")


def uses_fp16(engine_config: Any) -> bool:
    """Whether a job's engine config trains in fp16 anywhere, so that its loss scale means
    something (the LM's model pins no precision itself: the config says it all)."""
    return engine_config.base_dtype == "fp16" or engine_config.precision.uses_fp16
