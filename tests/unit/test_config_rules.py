"""One validation path: what initialize refuses for the config alone, load_config and
`hybrid-ray config check` refuse first with the same one-line message (the fuzz corpus in
test_config_fuzz.py checks the same at scale; these pin the exact messages)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hybrid_ray
from hybrid_ray.cli import main
from hybrid_ray.config import ConfigError, load_config
from hybrid_ray.engine import Topology

ONE = Topology(0, 1, torch.device("cpu"), None)
MICRO = {"train_micro_batch_size_per_gpu": 2}


def refusal(source: object) -> str:
    """load_config's one-line message; initialize must refuse with the same one."""
    with pytest.raises(ConfigError) as loaded:
        load_config(source)
    with pytest.raises(ConfigError) as built:
        hybrid_ray.initialize(torch.nn.Linear(2, 2), config=source, topology=ONE)
    assert str(built.value) == str(loaded.value) and "\n" not in str(loaded.value)
    return str(loaded.value)


def cli(tmp_path: Path, text: str, *flags: str, capsys: pytest.CaptureFixture) -> tuple:
    path = tmp_path / "cfg.json"
    path.write_text(text)
    code = main(["config", "check", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


# ---- batch sizes no world size can run ----------------------------------------------------------

@pytest.mark.parametrize("given, message", [
    ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: "
     "contradiction; got 7, 2, 2 (7 is not a multiple of 2 * 2); need train_batch_size = "
     "train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_size for some "
     "data-parallel size dp_size"),
    ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2},
     "train_batch_size, train_micro_batch_size_per_gpu: not divisible; got 3, 2; need "
     "train_batch_size divisible by train_micro_batch_size_per_gpu = 2 (whatever the "
     "data-parallel size)"),
    ({"train_batch_size": 5, "gradient_accumulation_steps": 2},
     "train_batch_size, gradient_accumulation_steps: not divisible; got 5, 2; need "
     "train_batch_size divisible by gradient_accumulation_steps = 2 (whatever the data-parallel "
     "size)"),
    ({"gradient_accumulation_steps": 4},
     "train_batch_size, train_micro_batch_size_per_gpu: missing; got neither; set at least one "
     "(gradient_accumulation_steps alone cannot size the batch)"),
])
def test_batch_impossible_at_every_world_size_is_refused_at_load(given, message):
    assert refusal(given) == message


def test_batch_for_another_world_size_loads_and_fails_at_engine_start(tmp_path, capsys):
    given = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
             "gradient_accumulation_steps": 2}  # 2 ranks
    assert load_config(given).resolve_batch(2).train_batch_size == 8
    with pytest.raises(ConfigError) as info:
        hybrid_ray.initialize(torch.nn.Linear(2, 2), config=given, topology=ONE)
    assert "got 8, 2, 2 with dp_size 1" in str(info.value)
    code, out, _ = cli(tmp_path, json.dumps(given), capsys=capsys)
    assert code == 0 and out.startswith("ok: ")
    code, _, err = cli(tmp_path, json.dumps(given), "--world-size", "1", capsys=capsys)
    assert code == 2 and err == f"error: {info.value}\n"
    code, out, _ = cli(tmp_path, json.dumps(given), "--world-size", "2", capsys=capsys)
    assert code == 0 and out.rstrip().endswith(
        "world size 2: batch 8 = micro-batch 2 x 2 accumulation steps x 2 ranks")
    code, _, err = cli(tmp_path, json.dumps(given), "--world-size", "0", capsys=capsys)
    assert code == 2 and err == "error: --world-size: out of range; got 0; allowed: >= 1\n"


# ---- optimizer, scheduler, loss scale -----------------------------------------------------------

def test_sgd_nesterov_needs_momentum_and_no_dampening():
    sgd = {**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}}
    assert refusal(sgd) == (
        "optimizer.params.nesterov: needs momentum > 0 and dampening 0; got true with momentum "
        "0.0, dampening 0.0; set optimizer.params.momentum > 0 and dampening 0, or nesterov false")
    sgd["optimizer"]["params"]["momentum"] = 0.9
    hybrid_ray.initialize(torch.nn.Linear(2, 2), config=sgd, topology=ONE)


def test_min_loss_scale_above_the_initial_scale_is_refused():
    fp16 = {"enabled": True, "initial_scale_power": 3, "min_loss_scale": 9}
    assert refusal({**MICRO, "fp16": fp16}) == (
        "fp16.min_loss_scale: out of range; got 9.0; allowed: <= 2**initial_scale_power = 8 "
        "(the dynamic scale starts there)")
    load_config({**MICRO, "fp16": {**fp16, "min_loss_scale": 8}})
    load_config({**MICRO, "fp16": {**fp16, "loss_scale": 128}})  # static: no floor to reach


@pytest.mark.parametrize("kind, params", [("WarmupLR", {"warmup_num_steps": 0}),
                                          ("WarmupCosineLR", {"total_num_steps": 5,
                                                              "warmup_num_steps": 0})])
def test_zero_warmup_steps_is_valid_as_in_deepspeed(kind, params):
    cfg = {**MICRO, "scheduler": {"type": kind, "params": params}}
    _, _, _, scheduler = hybrid_ray.initialize(torch.nn.Linear(2, 2), config=cfg, topology=ONE)
    assert scheduler.warmup_num_steps == 2  # DeepSpeed lifts a warm-up under 2 steps to 2


# ---- input limits and non-object tops -----------------------------------------------------------

def test_huge_integers_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "big.json"
    path.write_text('{"train_batch_size": ' + "9" * 5000 + "}")
    message = "train_batch_size: out of range; got an integer of 5000 digits; allowed: integers of magnitude < 2**63"
    assert refusal(path) == message
    assert refusal({"train_batch_size": 10**5000}) == message.replace("5000 digits", "16610 bits")
    assert refusal({"train_batch_size": 1e300}).startswith("train_batch_size: out of range; got 1e+300")


def test_deep_nesting_is_refused_naming_where(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"fp16":\n' + "[" * 50_000 + "]" * 50_000 + "}")
    assert refusal(path) == (f"{path}: nested too deeply at line 2 column 32; allowed: at most "
                             "32 levels of objects and lists")
    shallow = tmp_path / "shallow.json"
    shallow.write_text('{"fp16": ' + "[" * 40 + "]" * 40 + "}")
    deep_list = json.loads("[" * 40 + "]" * 40)
    for source in (shallow, {**MICRO, "fp16": deep_list}):
        assert refusal(source) == ("fp16" + "[0]" * 31 + ": nested too deeply; allowed: at most "
                                   "32 levels of objects and lists")
    cyclic: dict = dict(MICRO)
    cyclic["fp16"] = cyclic
    assert refusal(cyclic).startswith("fp16.fp16.fp16")


@pytest.mark.parametrize("text", ["[1, 2]", "3", "null", "true", '"fp16"'])
def test_a_file_that_is_not_an_object_is_one_line_exit_2(tmp_path, capsys, text):
    code, out, err = cli(tmp_path, text, capsys=capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: <config>: expected an object; got {json.loads(text)!r}")


def test_initialize_refuses_a_non_object_config_as_a_config_error():
    for value in (42, [1], True):
        assert refusal(value).startswith("<config>: expected an object; got ")
