"""No garbage under a checkpoint root defeats the good checkpoints in it: junk manifests are
skipped with a warning that names their folder, an unusable `latest` falls back to the newest
good checkpoint, files that pass their checksum but do not parse are a CheckpointError that names
them, a pickle that would run code is never run, and retention never raises after a commit."""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

from hybrid_ray.cli import main as cli
from hybrid_ray.engine import CheckpointError
from hybrid_ray.engine.checkpoint import read as cread
from tests.unit.test_checkpoint import CFG, make, state, train


@pytest.fixture
def two_saves(tmp_path: Path):
    """Checkpoints global_step1 and global_step2 (latest) under tmp_path; their states."""
    engine = make()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path)
    first = state(engine)
    train(engine, range(1, 2))
    engine.save_checkpoint(tmp_path)
    return tmp_path, first, state(engine)


def loads(root: Path, **kwargs):
    engine = make(seed=5, cfg=kwargs.pop("cfg", None))
    path, _ = engine.load_checkpoint(str(root), **kwargs)
    return Path(path).name, engine.global_steps, state(engine)


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def junk(root: Path, name: str, manifest) -> None:
    (root / name).mkdir()
    (root / name / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))


GOOD_ENTRY = {"sha256": "0" * 64, "bytes": 1}
JUNK_MANIFESTS = {
    "steps-null": {"format": cread.FORMAT, "tag": "x", "global_steps": None, "files": {"a": GOOD_ENTRY}},
    "steps-text": {"format": cread.FORMAT, "tag": "x", "global_steps": "abc", "files": {"a": GOOD_ENTRY}},
    "steps-bool": {"format": cread.FORMAT, "tag": "x", "global_steps": True, "files": {"a": GOOD_ENTRY}},
    "no-files": {"format": cread.FORMAT, "tag": "x", "global_steps": 3},
    "files-list": {"format": cread.FORMAT, "tag": "x", "global_steps": 3, "files": ["a"]},
    "entry-bad": {"format": cread.FORMAT, "tag": "x", "global_steps": 3, "files": {"a": {"sha256": 1}}},
    "name-escapes": {"format": cread.FORMAT, "tag": "x", "global_steps": 3, "files": {"../a": GOOD_ENTRY}},
    "not-object": [1, 2],
    "not-json": "{\"format\": ",
    "deep": "[" * 100000 + "]" * 100000,
    "other-format": {"format": "someone-else/3"},
}


@pytest.mark.parametrize("kind", sorted(JUNK_MANIFESTS))
def test_a_junk_manifest_is_skipped_with_one_warning(two_saves, kind, caplog) -> None:
    root, _, second = two_saves
    junk(root, f"junk-{kind}", JUNK_MANIFESTS[kind])
    with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
        name, step, got = loads(root)
    assert (name, step) == ("global_step2", 2) and same(got, second)
    warned = [r.getMessage() for r in caplog.records if f"junk-{kind}" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("skipping ")
    with pytest.raises(CheckpointError, match=f"junk-{kind}") as err:
        make().load_checkpoint(str(root), tag=f"junk-{kind}")
    assert "\n" not in str(err.value)


def test_retention_never_raises_after_a_commit(tmp_path: Path, caplog) -> None:
    cfg = {**CFG, "checkpoint": {"keep_last": 1}}
    engine = make(cfg=cfg)
    for step in range(3):
        train(engine, range(step, step + 1))
        if step == 1:  # junk appears mid-run: every later save still commits and returns
            junk(tmp_path, "junk", JUNK_MANIFESTS["steps-null"])
            (tmp_path / "foreign").mkdir()  # not ours at all: left alone
        engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "global_step3", "junk", "latest"]
    assert loads(tmp_path, cfg=cfg)[:2] == ("global_step3", 3)


@pytest.mark.parametrize("latest", [b"\xff\xfe", b"", b"  \n", b"../global_step1", b"/etc/passwd",
                                    b"global_step9", b"global_step2.tmp-abcd", b"a\x00b"],
                         ids=["non-utf8", "empty", "blank", "parent", "absolute", "absent", "staging", "nul"])
def test_an_unusable_latest_falls_back_to_the_newest_good(two_saves, latest, caplog) -> None:
    root, _, second = two_saves
    (root / "latest").write_bytes(latest)
    with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
        name, step, got = loads(root)
    assert (name, step) == ("global_step2", 2) and same(got, second)
    if latest.strip():
        assert "latest" in caplog.text


def test_no_latest_at_all_takes_the_newest(two_saves) -> None:
    root, _, second = two_saves
    (root / "latest").unlink()
    name, step, got = loads(root)
    assert (name, step) == ("global_step2", 2) and same(got, second)


def _replace_file(ckpt: Path, name: str, data: bytes, new_name: str | None = None) -> str:
    """Put `data` in the checkpoint as `new_name` (default: `name`), with a manifest that
    vouches for it, so only parsing can tell."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["files"].pop(name)
    (ckpt / name).unlink()
    new_name = new_name or name
    (ckpt / new_name).write_bytes(data)
    manifest["files"][new_name] = {**entry, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return new_name


class RunsCode:
    def __reduce__(self):  # unpickling would create the file named by the marker path
        import os
        return (os.system, (f"touch {RunsCode.marker}",))


@pytest.mark.parametrize("what", ["garbage-tensors", "pickle-payload", "meta-not-json", "meta-list",
                                  "meta-missing-key", "rng-garbage"])
def test_a_file_that_passes_its_checksum_but_does_not_parse(two_saves, what, tmp_path_factory,
                                                            capsys) -> None:
    root, first, _ = two_saves
    ckpt = root / "global_step2"
    params = next(ckpt.glob("params-rank*")).name
    RunsCode.marker = tmp_path_factory.mktemp("m") / "ran"
    if what == "garbage-tensors":
        bad = _replace_file(ckpt, params, b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    elif what == "pickle-payload":  # a .pt name: read with torch.load(weights_only=True)
        bad = _replace_file(ckpt, params, pickle.dumps({"w": RunsCode()}), params.rsplit(".", 1)[0] + ".pt")
    elif what == "meta-not-json":
        bad = _replace_file(ckpt, "meta.json", b"\x80not json")
    elif what == "meta-list":
        bad = _replace_file(ckpt, "meta.json", b"[1, 2]")
    elif what == "meta-missing-key":
        meta = json.loads((ckpt / "meta.json").read_text())
        del meta["world_size"]
        bad = _replace_file(ckpt, "meta.json", json.dumps(meta).encode())
    else:
        bad = _replace_file(ckpt, next(ckpt.glob("rng-rank*")).name, b"{\"torch\": 5}")
    with pytest.raises(CheckpointError) as err:
        make().load_checkpoint(str(root), tag="global_step2")
    message = str(err.value)
    assert "\n" not in message and bad in message or "meta.json" in message, message
    assert not RunsCode.marker.exists()
    name, step, got = loads(root)  # latest is unusable: the older good one is loaded, no refusal
    assert (name, step) == ("global_step1", 1) and same(got, first)
    assert not RunsCode.marker.exists()
    capsys.readouterr()
    assert cli(["checkpoint", "inspect", str(root), "--tag", "global_step2"]) == 1  # corrupt
    out = capsys.readouterr().out
    assert "global_step2  [latest]: CORRUPT" in out and f"{bad}" in out and "does not parse" in out, out
