"""Arrow token shards (memory-mapped, local and through pyarrow.fs) and jobs/prepare_data.py."""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from hybrid_ray.config import ConfigError
from hybrid_ray.data import CorpusSpec, ShardRef, TokenDataset, ensure_prepared, open_split, prepare
from hybrid_ray.data.prepare import DatasetMismatchError, load_tokenizer, split_entropy
from hybrid_ray.data.shards import ShardWriter
from hybrid_ray.lm.prepare_main import main as prepare_main


def write_stream(directory: Path, n: int, shard_tokens: int) -> list:
    writer = ShardWriter(pafs.LocalFileSystem(), str(directory), shard_tokens, np.dtype(np.uint16))
    for lo in range(0, n, 7):  # appended in pieces that do not line up with the shards
        writer.append(range(lo, min(n, lo + 7)))
    return writer.close()


def test_windows_over_shards_are_memory_mapped(tmp_path):
    shards = write_stream(tmp_path, 100, 40)
    assert [s["tokens"] for s in shards] == [40, 40, 20]
    ds = TokenDataset([ShardRef(str(tmp_path / s["name"]), s["tokens"]) for s in shards], seq_len=4)
    assert len(ds) == 9 + 9 + 4  # (n - 1) // 4 per shard; windows never cross shards
    x, y = ds[0]
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4] and x.dtype.is_floating_point is False
    assert ds[9][0].tolist() == [40, 41, 42, 43]  # first window of the second shard
    assert ds[21][1].tolist() == [93, 94, 95, 96]
    with pytest.raises(IndexError):
        ds[22]
    before = pa.total_allocated_bytes()
    tokens = ds.tokens(2)
    # A mapped file is not allocated by Arrow's memory pool, and numpy sees it read-only.
    assert pa.total_allocated_bytes() == before and not tokens.flags.writeable
    assert tokens.dtype == np.uint16 and tokens.tolist() == list(range(80, 100))
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker or Ray receives
    assert clone._arrays == {} and clone[21][1].tolist() == [93, 94, 95, 96]


def test_shards_through_pyarrow_fs_are_cached_locally(tmp_path):
    remote = tmp_path / "bucket"
    shards = write_stream(remote / "train", 50, 30)
    # Any filesystem other than the local one is treated as remote: copied, then mapped.
    fs = pafs.SubTreeFileSystem(str(remote), pafs.LocalFileSystem())
    ds = TokenDataset.from_paths([f"train/{s['name']}" for s in shards], seq_len=5, filesystem=fs,
                                 cache_dir=str(tmp_path / "cache"))
    assert [s.tokens for s in ds.shards] == [30, 20]  # read from the footers
    assert ds[5][0].tolist() == [30, 31, 32, 33, 34]  # (30 - 1) // 5 = 5 windows in shard 0
    assert len(list((tmp_path / "cache").iterdir())) == 1  # only the shard that was read


def text_folder(root: Path) -> Path:
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "skipped" / "__pycache__").mkdir(parents=True)
    for i in range(12):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # note {j}\n" for j in range(30))
        (src / ("pkg" if i % 3 else ".") / f"m{i}.py").write_text(body)
    (src / "README.md").write_text("A tiny corpus for the tests. " * 40)
    (src / "skipped" / "__pycache__" / "x.py").write_text("never read")
    (src / "data.bin").write_bytes(b"\0" * 100)
    return src


def test_prepare_holds_out_whole_files_and_is_deterministic(tmp_path):
    src = text_folder(tmp_path)
    spec = CorpusSpec(source=str(src), vocab_size=300, val_fraction=0.2, shard_tokens=500)
    meta = prepare(spec, str(tmp_path / "a"), log=lambda _: None)
    prepare(spec, str(tmp_path / "b"), log=lambda _: None)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    for rel in files_a:  # byte-identical: tokenizer, shards and meta
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    assert tr["files"] + va["files"] == 13 and va["files"] >= 1  # 12 .py + README, not .bin/cache
    assert len(tr["shards"]) > 1 and meta["tokenizer"] == {"kind": "bpe", "vocab_size": 300, "eot_id": 0}
    tok = load_tokenizer(str(tmp_path / "a"), meta)
    val = open_split(str(tmp_path / "a"), meta, "val", 8)
    val_text = tok.decode(val.tokens(0).tolist())
    held_out = meta["val_files"][0]
    assert (src / held_out).read_text()[:200] in val_text
    train_text = "".join(tok.decode(open_split(str(tmp_path / "a"), meta, "train", 8).tokens(s).tolist())
                         for s in range(len(tr["shards"])))
    assert (src / held_out).read_text()[:200] not in train_text
    assert 0 < split_entropy(val, tok.vocab_size) < np.log(300)


def test_byte_tokenizer_and_mismatch_errors(tmp_path):
    src = text_folder(tmp_path)
    spec = CorpusSpec(source=str(src), tokenizer="bytes", val_fraction=0.3)
    meta = ensure_prepared(spec, str(tmp_path / "d"), log=lambda _: None)
    assert meta["tokenizer"] == {"kind": "bytes", "vocab_size": 257, "eot_id": 256}
    assert meta["dtype"] == "uint16" and not (tmp_path / "d" / "tokenizer.json").exists()
    assert ensure_prepared(spec, str(tmp_path / "d")) == meta  # found, not rebuilt
    other = CorpusSpec(source=str(src), tokenizer="bytes", val_fraction=0.5)
    with pytest.raises(DatasetMismatchError, match=r"prepared with other settings \(val_fraction"):
        ensure_prepared(other, str(tmp_path / "d"))
    with pytest.raises(FileNotFoundError, match="no prepared dataset"):
        ensure_prepared(spec, str(tmp_path / "none"), allow_prepare=False)
    with pytest.raises(FileNotFoundError, match="need at least 2"):
        prepare(CorpusSpec(source=str(src / "skipped")), str(tmp_path / "e"))


def test_prepare_data_command(tmp_path, capsys):
    src = text_folder(tmp_path)
    out = str(tmp_path / "ds")
    assert prepare_main(["--out", out, "--source", str(src), "--tokenizer", "bytes",
                         "--max-bytes", "5e3", "--extensions", ".py"]) == 0
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["corpus"]["max_bytes"] == 5000 and meta["corpus"]["extensions"] == [".py"]
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] <= 5000
    assert "dataset " in capsys.readouterr().out
    digest = hashlib.sha256((tmp_path / "ds" / "meta.json").read_bytes()).hexdigest()
    assert prepare_main(["--out", out, "--source", str(src), "--tokenizer", "bytes",
                         "--max-bytes", "5e3", "--extensions", ".py", "--force"]) == 0
    assert hashlib.sha256((tmp_path / "ds" / "meta.json").read_bytes()).hexdigest() == digest
    assert prepare_main(["--out", out, "--tokenizer", "bytes", "--vocab-size", "300"]) == 2
    assert capsys.readouterr().err == ("error: corpus.vocab_size: only for tokenizer 'bpe'; got 300; "
                                       "remove it: the byte tokenizer's vocabulary is fixed (257)\n")
    assert prepare_main(["--config", "x.json", "--out", out]) == 2
    assert "--config, --out: contradiction" in capsys.readouterr().err


def test_corpus_spec_is_strict():
    from hybrid_ray.config.loader import load_dataclass

    with pytest.raises(ConfigError, match=r"^data.corpus.tokeniser: unknown key; did you mean 'tokenizer'"):
        load_dataclass(CorpusSpec, {"tokeniser": "bpe"}, "data.corpus")
    with pytest.raises(ConfigError, match=r"^c.tokenizer: invalid value; got 'wordpiece'"):
        load_dataclass(CorpusSpec, {"tokenizer": "wordpiece"}, "c")
    with pytest.raises(ConfigError, match=r"^c.sources: given together with source"):
        load_dataclass(CorpusSpec, {"source": "/x", "sources": ["stdlib"]}, "c")


def test_several_sources_are_read_in_order_without_repeated_files(tmp_path):
    from hybrid_ray.config.loader import load_dataclass
    from hybrid_ray.data.corpus import load_corpus

    a, b = tmp_path / "a", tmp_path / "b"
    for root, files in ((a, {"one.py": "x = 1\n", "two.py": "y = 2\n"}),
                        (b, {"copy.py": "x = 1\n", "three.txt": "z\n", "four.md": "w\n"})):
        root.mkdir()
        for name, text in files.items():
            (root / name).write_text(text)
    spec = load_dataclass(CorpusSpec, {"sources": [str(a), str(b)], "val_fraction": 0.2}, "data.corpus")
    got = load_corpus(spec)
    assert got.roots == (a.resolve(), b.resolve()) and got.skipped_copies == 1  # b/copy.py is a/one.py
    assert sorted(got.train + got.val) == sorted([b"x = 1\n", b"y = 2\n", b"z\n", b"w\n"])
    assert got.val_names[0].startswith((str(a), str(b)))  # names carry their source
    assert load_corpus(spec).digest == got.digest and len(got.digest) == 64
    (b / "four.md").write_text("changed\n")
    assert load_corpus(spec).digest != got.digest  # the digest says what the text was
    meta = prepare(load_dataclass(CorpusSpec, {"sources": [str(a), str(b)], "tokenizer": "bytes",
                                                "val_fraction": 0.2}, "data.corpus"), str(tmp_path / "ds"))
    assert meta["sources"] == [str(a.resolve()), str(b.resolve())] and meta["skipped_copies"] == 1
    assert meta["corpus_sha256"] and "sources" in meta["corpus"]


def test_a_spec_without_sources_matches_datasets_prepared_before_the_key():
    assert "sources" not in CorpusSpec().to_dict()
