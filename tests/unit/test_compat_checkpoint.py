"""client_state beyond JSON (client_state.pt, loaded with weights_only=True) and
deepspeed.utils.zero_to_fp32 over a saved checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import hybrid_ray as deepspeed
from hybrid_ray.engine import CheckpointError
from hybrid_ray.engine.checkpoint import offline
from hybrid_ray.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                           get_fp32_state_dict_from_zero_checkpoint,
                                           load_state_dict_from_zero_checkpoint, main)

CFG = {"train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}


def engine(seed: int = 0):
    torch.manual_seed(seed)
    e, *_ = deepspeed.initialize(model=nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)), config=CFG)
    return e


def test_client_state_with_tensors_and_numpy_round_trips(tmp_path: Path) -> None:
    state = {"step": 7, "t": torch.arange(3), "pair": (1, 2.5), 3: "int key", "raw": b"\x00",
             "np_rng": np.random.get_state(), "arr": np.ones(2, np.float16), "x": np.int64(4),
             "nested": {"l": [None, True, torch.zeros(2, 2)]}}
    e = engine()
    path = e.save_checkpoint(str(tmp_path), tag="a", client_state=state)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert "client_state.pt" in manifest["files"] and len(manifest["files"]["client_state.pt"]["sha256"]) == 64
    assert json.loads((Path(path) / "meta.json").read_text())["client_state"] == {}
    _, got = engine(1).load_checkpoint(str(tmp_path), tag="a")
    assert got["step"] == 7 and got["pair"] == (1, 2.5) and got[3] == "int key" and got["raw"] == b"\x00"
    assert torch.equal(got["t"], torch.arange(3)) and torch.equal(got["nested"]["l"][2], torch.zeros(2, 2))
    assert got["np_rng"][0] == "MT19937" and np.array_equal(got["np_rng"][1], state["np_rng"][1])
    assert got["arr"].dtype == np.float16 and got["x"] == 4
    assert offline.inspect(*offline.locate(str(tmp_path), "a")[:2], "a").ok


def test_json_client_state_stays_in_meta(tmp_path: Path) -> None:
    path = engine().save_checkpoint(str(tmp_path), client_state={"step": 1, "name": "x"})
    assert not (Path(path) / "client_state.pt").exists()
    assert engine().load_checkpoint(str(tmp_path))[1] == {"step": 1, "name": "x"}


class Custom:
    pass


@pytest.mark.parametrize("state, key", [
    ({"a": {"b": Custom()}}, r"client_state\['a'\]\['b'\]: a .*Custom"),
    ({"o": np.array([object()])}, r"client_state\['o'\]: a numpy.ndarray"),
    ({"g": (x for x in ())}, r"client_state\['g'\]: a builtins.generator"),
])
def test_what_weights_only_cannot_load_is_refused_by_key(tmp_path: Path, state, key) -> None:
    with pytest.raises(CheckpointError, match=key):
        engine().save_checkpoint(str(tmp_path), client_state=state)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_pickle_payload_in_client_state_pt_is_not_unpickled(tmp_path: Path) -> None:
    import hashlib
    import pickle

    path = Path(engine().save_checkpoint(str(tmp_path), tag="a", client_state={"t": (1,)}))
    payload = pickle.dumps(Custom())
    (path / "client_state.pt").write_bytes(payload)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["client_state.pt"] = {"sha256": hashlib.sha256(payload).hexdigest(),
                                            "bytes": len(payload)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"client_state.pt does not load with weights_only"):
        engine().load_checkpoint(str(tmp_path), tag="a")


def test_zero_to_fp32(tmp_path: Path, capsys) -> None:
    e = engine()
    x = torch.randn(2, 3)
    e.backward(e(x).float().pow(2).sum())
    e.step()
    e.save_checkpoint(str(tmp_path / "ckpt"), tag="t1")
    expected = e.consolidated_state_dict(torch.float32)
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in state)
    assert state["0.weight"].dtype == torch.float32
    out = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "w.bin"), tag="t1")
    assert torch.equal(torch.load(out, weights_only=True)["0.weight"], expected["0.weight"])
    (tmp_path / "dir").mkdir()
    assert convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "dir")) \
        == str(tmp_path / "dir" / "pytorch_model.bin")
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out
    fresh = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    loaded = load_state_dict_from_zero_checkpoint(fresh, str(tmp_path / "ckpt"))
    assert torch.equal(loaded[0].weight, expected["0.weight"])
