"""The LM job's pipelined GPT: its weights under the plain GPT's names (the exported model), and
the rule that a run keeps its model's form across resumes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hybrid_ray
from hybrid_ray.config import ConfigError
from hybrid_ray.lm.job import load_job
from hybrid_ray.lm.pipeline_model import as_gpt_state, gpt_pipeline, is_pipeline_state
from hybrid_ray.lm.setup import build_model, build_stages, whole_params
from hybrid_ray.models.gpt import GPT, GPT_SIZES
from tests.unit.test_lm_job import tiny_job


def test_the_pipelined_gpts_state_under_gpt_names_is_the_same_model() -> None:
    cfg = GPT_SIZES["tiny"]
    torch.manual_seed(0)
    piped = gpt_pipeline(cfg, seed_layers=True)
    state = as_gpt_state(piped.state_dict())
    assert is_pipeline_state(piped.state_dict()) and not is_pipeline_state(state)
    gpt = GPT(cfg)
    gpt.load_state_dict(state, strict=True)  # every name, one to one (head.weight is wte's)
    assert as_gpt_state(gpt.state_dict()).keys() == gpt.state_dict().keys()  # GPT's pass through
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    tgt = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    torch.testing.assert_close(gpt(idx, tgt), piped.loss_fn(piped(idx), tgt), rtol=0, atol=0)


def _job(tmp_path: Path, pipeline: int):
    raw = tiny_job(tmp_path / "data", tmp_path / "run")
    raw["engine"]["pipeline_model_parallel_size"] = pipeline
    return load_job(raw)


def test_a_run_keeps_its_models_form_across_resumes(tmp_path: Path) -> None:
    job = _job(tmp_path, 1)
    assert whole_params(job, 257) == build_model(job, 257, 0).num_params()
    assert type(build_stages(job, 257, 0, resuming=True)) is GPT  # nothing to resume: the GPT
    engine, *_ = hybrid_ray.initialize(model=build_model(job, 257, 0), config=job.engine)
    engine.save_checkpoint(str(tmp_path / "run" / "checkpoints"))
    engine.destroy()
    # the plain GPT's checkpoint cannot feed a pipeline: one line naming the key
    with pytest.raises(ConfigError, match=r"^engine.pipeline_model_parallel_size: 2, but the run's "
                                          r"checkpoints in .* hold the GPT unpipelined"):
        build_stages(_job(tmp_path, 2), 257, 0, resuming=True)
    assert type(build_stages(job, 257, 0, resuming=True)) is GPT
