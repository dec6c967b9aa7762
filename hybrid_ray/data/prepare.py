"""Build a token dataset from a folder of text: corpus -> tokenizer -> Arrow shards -> meta.json.

Layout of a prepared dataset (a local folder or any pyarrow.fs URI):

    meta.json          written last: its presence means the dataset is complete
    tokenizer.json     the trained BPE (Hugging Face `tokenizers` format); absent for bytes
    train/shard-00000.arrow ...
    val/shard-00000.arrow ...

Deterministic: the same source, spec and `tokenizers` version give the same files (the test
suite checks it). Each document (file) ends with the end-of-text token.
"""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Callable, Optional

import numpy as np
import pyarrow.fs as pafs

from .corpus import Corpus, CorpusSpec, load_corpus
from .shards import ShardRef, ShardWriter, TokenDataset, resolve, token_dtype
from .tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Tokenizer

FORMAT = "hybrid_ray.tokens/1"
META = "meta.json"
SPLITS = ("train", "val")
_ENCODE_CHUNK = 256  # documents per encode_batch call: bounds memory on large corpora


class DatasetMismatchError(ValueError):
    """A prepared dataset exists at the path but was built from a different spec."""


def read_meta(path: str) -> Optional[dict]:
    """The dataset's meta.json, or None when there is no complete dataset at path."""
    fs, root = resolve(path)
    if fs.get_file_info(f"{root}/{META}").type != pafs.FileType.File:
        return None
    with fs.open_input_stream(f"{root}/{META}") as f:
        return json.loads(f.read().decode())


def prepare(spec: CorpusSpec, path: str, log: Callable[[str], None] = print) -> dict:
    """Build the dataset at path (overwriting an incomplete one); returns its meta."""
    start = time.perf_counter()
    fs, root = resolve(path)
    corpus = load_corpus(spec)
    tok = _build_tokenizer(spec, corpus, fs, root)
    dtype = token_dtype(tok.vocab_size)
    splits = {name: _write_split(tok, docs, fs, f"{root}/{name}", spec.shard_tokens, dtype)
              for name, docs in (("train", corpus.train), ("val", corpus.val))}
    meta = {"format": FORMAT, "corpus": spec.to_dict(), "source": str(corpus.root),
            "sources": [str(r) for r in corpus.roots], "corpus_sha256": corpus.digest,
            "skipped_copies": corpus.skipped_copies,
            "python": sys.version.split()[0], "dtype": dtype.name,
            "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "splits": splits, "val_files": corpus.val_names}
    with fs.open_output_stream(f"{root}/{META}") as f:
        f.write(json.dumps(meta, indent=1).encode())
    tr, va = splits["train"], splits["val"]
    log(f"prepared {path}: {tok.kind} vocabulary {tok.vocab_size}; train {tr['files']} files, "
        f"{tr['bytes'] / 1e6:.2f} MB -> {tr['tokens']:,} tokens ({len(tr['shards'])} shards); val "
        f"{va['files']} files, {va['tokens']:,} tokens; {time.perf_counter() - start:.1f} s")
    return meta


def ensure_prepared(spec: CorpusSpec, path: str, allow_prepare: bool = True,
                    log: Callable[[str], None] = print) -> dict:
    """The meta of the dataset at path, preparing it first when it is missing.

    An existing dataset built from another spec is an error rather than silently used or
    overwritten: training on other data than the config says is the worse surprise.
    """
    meta = read_meta(path)
    if meta is None:
        if not allow_prepare:
            raise FileNotFoundError(f"data.path {path}: no prepared dataset (no {META}); run "
                                    "jobs/prepare_data.py or set data.prepare: true")
        return prepare(spec, path, log)
    if meta.get("format") != FORMAT:
        raise DatasetMismatchError(f"data.path {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["corpus"] != spec.to_dict():
        diff = sorted(k for k in spec.to_dict() if meta["corpus"].get(k) != spec.to_dict()[k])
        raise DatasetMismatchError(
            f"data.path {path}: prepared with other settings ({', '.join(diff)}: "
            f"{ {k: meta['corpus'].get(k) for k in diff} }); delete it or choose another data.path")
    return meta


def open_split(path: str, meta: dict, split: str, seq_len: int,
               cache_dir: Optional[str] = None) -> TokenDataset:
    """The split's windows of seq_len tokens, memory-mapped."""
    fs, root = resolve(path)
    refs = [ShardRef(f"{root}/{split}/{s['name']}", s["tokens"]) for s in meta["splits"][split]["shards"]]
    return TokenDataset(refs, seq_len, filesystem=fs, cache_dir=cache_dir)


def load_tokenizer(path: str, meta: dict) -> Tokenizer:
    if meta["tokenizer"]["kind"] == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    fs, root = resolve(path)
    with fs.open_input_stream(f"{root}/{TOKENIZER_FILE}") as f:
        return BPETokenizer(HFTokenizer.from_str(f.read().decode()))


def split_entropy(dataset: TokenDataset, vocab_size: int) -> float:
    """Entropy of a split's token frequencies, in nats/token: the loss of the best context-free
    model. Fitted on the very tokens it scores, so no unigram model does better; a language model
    that beats it has learned something from context. Counted one mapped shard at a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in range(len(dataset.shards)):
        counts += np.bincount(dataset.tokens(s), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _build_tokenizer(spec: CorpusSpec, corpus: Corpus, fs: pafs.FileSystem, root: str) -> Tokenizer:
    if spec.tokenizer == "bytes":
        return ByteTokenizer()
    tok = BPETokenizer.train(corpus.train, spec.bpe_vocab_size)
    fs.create_dir(root, recursive=True)
    with fs.open_output_stream(f"{root}/{TOKENIZER_FILE}") as f:
        f.write(tok.to_str().encode())
    return tok


def _write_split(tok: Tokenizer, docs: list, fs: pafs.FileSystem, directory: str,
                 shard_tokens: int, dtype: np.dtype) -> dict:
    writer = ShardWriter(fs, directory, shard_tokens, dtype)
    tokens = 0
    for lo in range(0, len(docs), _ENCODE_CHUNK):
        for ids in tok.encode_batch(docs[lo:lo + _ENCODE_CHUNK]):
            ids.append(tok.eot_id)
            writer.append(ids)
            tokens += len(ids)
    return {"files": len(docs), "bytes": sum(len(d) for d in docs), "tokens": tokens,
            "shards": writer.close()}


def bits_per_byte(nats_per_token: float, split_meta: dict) -> float:
    """A loss in nats/token as bits per byte of text: comparable across tokenizers."""
    return nats_per_token * split_meta["tokens"] / split_meta["bytes"] / math.log(2)
