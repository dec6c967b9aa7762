"""`jobs/prepare_data.py`: build a token dataset from a job file's data section or from flags."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import pyarrow.fs as pafs

from hybrid_ray.config import ConfigError
from hybrid_ray.config.loader import load_dataclass
from hybrid_ray.data.corpus import CorpusSpec
from hybrid_ray.data.prepare import META, DatasetMismatchError, ensure_prepared
from hybrid_ray.data.shards import resolve

EXIT_CONFIG = 2
# flag -> CorpusSpec field; the values are checked by the same loader as a job file's.
SPEC_FLAGS = {"source": "source", "tokenizer": "tokenizer", "vocab_size": "vocab_size",
              "max_bytes": "max_bytes", "val_fraction": "val_fraction",
              "shard_tokens": "shard_tokens", "extensions": "extensions"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prepare_data.py", description=__doc__)
    p.add_argument("--config", help="job file: use its data section (path and corpus)")
    p.add_argument("--out", help="dataset folder or pyarrow.fs URI (without --config)")
    p.add_argument("--source", help="folder of text files (default: Python's standard library)")
    p.add_argument("--tokenizer", help="bpe (default) or bytes")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, help="BPE vocabulary (default 4096)")
    p.add_argument("--max-bytes", dest="max_bytes", type=float, help="cap on text read (default 4e6)")
    p.add_argument("--val-fraction", dest="val_fraction", type=float,
                   help="share of the text held out for validation (default 0.05)")
    p.add_argument("--shard-tokens", dest="shard_tokens", type=float, help="tokens per shard")
    p.add_argument("--extensions", help="comma-separated file endings (default .py,.txt,.rst,.md)")
    p.add_argument("--force", action="store_true", help="rebuild even if the dataset exists")
    return p


def spec_from_flags(args: argparse.Namespace) -> CorpusSpec:
    raw = {field: getattr(args, flag) for flag, field in SPEC_FLAGS.items()
           if getattr(args, flag) is not None}
    if "extensions" in raw:
        raw["extensions"] = [e.strip() for e in raw["extensions"].split(",") if e.strip()]
    return load_dataclass(CorpusSpec, raw, "corpus")


def resolve_target(args: argparse.Namespace) -> tuple:
    """(spec, path) from --config or from the flags; ConfigError on a contradiction."""
    if args.config:
        flags = [f"--{f.replace('_', '-')}" for f in ["out", *SPEC_FLAGS] if getattr(args, f) is not None]
        if flags:
            raise ConfigError(f"--config, {', '.join(flags)}: contradiction; the job file's data "
                              "section says what to build: edit it, or leave --config out")
        from hybrid_ray.lm.job import load_job

        job = load_job(args.config)
        return job.data.corpus, job.data.path
    if not args.out:
        raise ConfigError("--out: missing; pass the dataset folder (or --config JOB.json)")
    return spec_from_flags(args), args.out


def forget(path: str) -> None:
    """Mark a dataset incomplete before rebuilding it: meta.json is written last and removed
    first, so a rebuild that stops halfway never looks complete."""
    fs, root = resolve(path)
    if fs.get_file_info(f"{root}/{META}").type == pafs.FileType.File:
        fs.delete_file(f"{root}/{META}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        spec, path = resolve_target(args)
        if args.force:
            forget(path)
        meta = ensure_prepared(spec, path)
    except (ConfigError, DatasetMismatchError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(f"dataset {path}: {meta['tokenizer']['kind']} vocabulary {meta['tokenizer']['vocab_size']}, "
          f"train {tr['tokens']:,} tokens, val {va['tokens']:,} tokens "
          f"(source {', '.join(meta.get('sources') or [meta['source']])})")
    return 0
