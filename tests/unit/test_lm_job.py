"""The local LM job: stdlib byte corpus, strict job file, and a tiny single-process run."""
from __future__ import annotations

import math

import pytest
import torch

from hybrid_ray.config import ConfigError, NotSupportedError
from hybrid_ray.lm.job import load_job
from hybrid_ray.lm.stdlib_bytes import (ByteWindows, evenly_spaced, load_corpus, stdlib_sources,
                                        unigram_entropy)

TINY = {
    "engine": {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10, "seed": 0,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
               "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32},
    "train": {"steps": 40, "eval_interval": 20, "eval_samples": 16, "corpus_bytes": 150_000,
              "sample_bytes": 20, "require_below_baseline": False},
}


def test_corpus_is_deterministic_and_validation_is_held_out_files():
    a, b = load_corpus(200_000, 0.1), load_corpus(200_000, 0.1)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.val_files >= 1 and a.train.numel() + a.val.numel() <= 200_000
    files = stdlib_sources()
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)
    # Validation is the tail of the same ordered file list, not a slice of the training bytes.
    first_val = files[a.train_files].read_bytes()
    assert bytes(a.val[:len(first_val)].tolist()) == first_val


def test_unigram_entropy_and_windows():
    assert unigram_entropy(torch.arange(256, dtype=torch.uint8)) == pytest.approx(math.log(256))
    assert unigram_entropy(torch.zeros(10, dtype=torch.uint8)) == 0.0
    w = ByteWindows(torch.arange(10, dtype=torch.uint8), seq_len=3)
    assert len(w) == 3
    x, y = w[2]
    assert x.tolist() == [6, 7, 8] and y.tolist() == [7, 8, 9] and x.dtype == torch.long
    assert evenly_spaced(10, None) == list(range(10)) and evenly_spaced(10, 4) == [0, 2, 5, 7]


def test_job_file_errors_name_the_section():
    with pytest.raises(ConfigError, match=r"^train.steps: missing required key"):
        load_job({"engine": {}, "train": {}})
    with pytest.raises(ConfigError, match=r"^egnine: unknown key; did you mean 'engine'\?"):
        load_job({"engine": {}, "egnine": {}, "train": {"steps": 1}})
    with pytest.raises(NotSupportedError,
                       match=r"^\[engine\] activation_checkpointing.partition_activations"):
        load_job({"engine": {"activation_checkpointing": {"partition_activations": True}},
                  "train": {"steps": 1}})
    with pytest.raises(ConfigError, match=r"^engine: missing required section"):
        load_job({"train_micro_batch_size_per_gpu": 4})


def test_tiny_single_process_run_learns(monkeypatch, capsys):
    from hybrid_ray.lm.loop import train

    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    result = train(load_job(TINY))
    out = capsys.readouterr().out
    assert "step    40/40" in out and "eval  step 20" in out and "final: train loss" in out
    assert result.steps == 40 and len(result.sample) >= 20
    # From ln(256) = 5.55 at initialisation to well below: the loop, engine and data fit together.
    assert result.val_loss < 4.0 and result.train_loss < 4.0
    assert 2.5 < result.unigram_nats < 4.5
