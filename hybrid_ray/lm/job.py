"""The job file of the local language-model run: engine config plus model and run settings.

    {"engine": {...DeepSpeed-style config...}, "model": {...}, "train": {...}}

The engine rejects unknown keys, so the model and run settings cannot live in its config; they
sit in their own sections, which are just as strict (same loader, same one-line errors). The
`engine` section is passed to `hybrid_ray.initialize` unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from hybrid_ray.config import Config, ConfigError, load_config
from hybrid_ray.config.api import read_json
from hybrid_ray.config.errors import Verbatim, config_error, unknown_key_error
from hybrid_ray.config.loader import checked, load_dataclass

SECTIONS = ("engine", "model", "train")


@dataclass(frozen=True)
class ModelSection:
    """Shape of the GPT (vocabulary is fixed at 256: the tokens are bytes)."""

    n_layer: int = checked(4, ge=1)
    """Transformer blocks."""
    n_head: int = checked(4, ge=1)
    """Attention heads per block; must divide d_model."""
    d_model: int = checked(128, ge=1)
    """Width of the residual stream."""
    seq_len: int = checked(128, ge=2)
    """Context length in bytes."""
    dropout: float = checked(0.0, ge=0, lt=1)
    """Dropout in attention (0 for short runs: nothing to regularise yet)."""

    def validate(self, path: str) -> None:
        if self.d_model % self.n_head:
            raise config_error(f"{path}.d_model, {path}.n_head", "not divisible",
                               Verbatim(f"{self.d_model}, {self.n_head}"),
                               "need d_model divisible by n_head")


@dataclass(frozen=True)
class TrainSection:
    """Length of the run, evaluation, data and the closing sample."""

    steps: int = checked(ge=1)
    """Optimizer steps (required); a scheduler's total_num_steps must equal it."""
    eval_interval: int = checked(100, ge=1)
    """Evaluate validation loss every this many steps (and always at the end)."""
    eval_samples: Optional[int] = checked(256, ge=1)
    """Validation windows in periodic evaluations; null means all. The final one uses all."""
    corpus_bytes: int = checked(3_500_000, ge=10_000)
    """Cap on the stdlib bytes read (files are taken whole, in sorted order)."""
    val_fraction: float = checked(0.05, gt=0, lt=1)
    """Fraction of the files, the last ones, held out for validation."""
    sample_bytes: int = checked(300, ge=0)
    """Bytes generated from the trained model at the end; 0 skips the sample."""
    sample_prompt: str = "def "
    """Text the sample starts from."""
    temperature: float = checked(0.8, ge=0)
    """Sampling temperature; 0 means greedy."""
    require_below_baseline: bool = True
    """Fail the run if the final validation loss is not below the unigram baseline."""


@dataclass(frozen=True)
class Job:
    """A validated job file."""

    engine: Config
    train: TrainSection
    model: ModelSection = field(default_factory=ModelSection)
    path: str = ""
    """The file it came from ('' for a dict)."""


def is_job_file(raw: Any) -> bool:
    """A job file has an `engine` section; a plain engine config never has that key."""
    return isinstance(raw, Mapping) and "engine" in raw


def load_job(source: Union[str, os.PathLike, Mapping[str, Any]]) -> Job:
    """Load and validate a job file (path or dict); every error is one-line ConfigError."""
    path = "" if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else read_json(Path(source))
    if not isinstance(raw, Mapping):
        raise config_error("", "expected an object", raw, "sections: " + ", ".join(SECTIONS))
    if not is_job_file(raw):
        raise config_error("engine", "missing required section", allowed=(
            "a job file holds {\"engine\": {...engine config...}, \"model\": {...}, "
            "\"train\": {...}}; see jobs/configs/small_cpu.json"))
    for key in raw:
        if key not in SECTIONS:
            raise unknown_key_error("", key, SECTIONS)
    if "train" not in raw:
        raise config_error("train", "missing required section",
                           allowed="a job file needs 'engine' and 'train' ('model' is optional)")
    engine = _load_engine(raw["engine"])
    model = load_dataclass(ModelSection, raw.get("model", {}), "model")
    train = load_dataclass(TrainSection, raw["train"], "train")
    _check_schedule(engine, train)
    return Job(engine, train, model, path)


def _load_engine(raw: Any) -> Config:
    # The engine's messages name paths inside its own config; say which section they are in.
    try:
        return load_config(raw)
    except ConfigError as exc:
        raise type(exc)(f"[engine] {exc}", f"engine.{exc.path}" if exc.path else "engine") from None


def _check_schedule(engine: Config, train: TrainSection) -> None:
    """A schedule that ends before or after the run is almost always a forgotten edit."""
    total = getattr(engine.scheduler.params, "total_num_steps", None) if engine.scheduler else None
    if total is not None and total != train.steps:
        raise config_error("engine.scheduler.params.total_num_steps, train.steps", "contradiction",
                           Verbatim(f"{total}, {train.steps}"),
                           "make them equal: the learning-rate schedule should end with the run")
