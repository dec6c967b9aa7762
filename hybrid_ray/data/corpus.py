"""Which text goes into a dataset: the files of a folder, capped, split into train and validation.

The default folder is this Python's standard library: real text (code, docstrings, comments, and
the reference documentation in pydoc_data/), present offline on every machine with Python, and
identical for a given Python version. Any other folder of text files works the same way.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Literal, Optional, Tuple

from hybrid_ray.config.errors import config_error
from hybrid_ray.config.loader import checked, to_plain

DEFAULT_EXCLUDE = ("site-packages", "dist-packages", "__pycache__", ".git", "test", "tests",
                   "idle_test", "encodings")


@dataclass(frozen=True)
class CorpusSpec:
    """How to build a dataset; meta.json keeps it, so a prepared dataset is checked against it."""

    source: Optional[str] = None
    """Folder of text files; null means this Python's standard library (sysconfig 'stdlib')."""
    sources: Tuple[str, ...] = ()
    """Several sources read one after the other, instead of `source`: folders, or "stdlib" and
    "purelib" (this Python's standard library and its installed packages, site-packages). Files
    whose bytes another file already gave are skipped (vendored copies), so no text repeats."""
    extensions: Tuple[str, ...] = (".py", ".txt", ".rst", ".md")
    """File name endings to read (case-sensitive)."""
    exclude_dirs: Tuple[str, ...] = DEFAULT_EXCLUDE
    """Folder names skipped anywhere below the source. The defaults leave out installed packages,
    caches, and the standard library's huge, repetitive test suite and codec tables."""
    tokenizer: Literal["bpe", "bytes"] = "bpe"
    """'bpe': byte-level BPE trained here on the training split; 'bytes': one token per byte."""
    vocab_size: Optional[int] = checked(None, ge=260, le=2**20)
    """BPE vocabulary including the end-of-text token; null means 4096. Not allowed with 'bytes'
    (its vocabulary is the 256 bytes plus end-of-text)."""
    max_bytes: int = checked(4_000_000, ge=1_000)
    """Cap on the text read: whole files in sorted order (top-level files first) until the next
    would pass it. Keeps preparation and an epoch short on a CPU."""
    val_fraction: float = checked(0.05, gt=0, lt=1)
    """Share of the text (bytes) held out for validation: whole files, chosen by a hash of their
    paths (at least one file)."""
    shard_tokens: int = checked(1 << 22, ge=16)
    """Tokens per Arrow shard (the last shard of a split is shorter)."""

    def validate(self, path: str) -> None:
        if self.sources and self.source is not None:
            raise config_error(f"{path}.sources", "given together with source", list(self.sources),
                               "keep one: sources lists every folder, source names one")
        if self.tokenizer == "bytes" and self.vocab_size is not None:
            raise config_error(f"{path}.vocab_size", "only for tokenizer 'bpe'", self.vocab_size,
                               "remove it: the byte tokenizer's vocabulary is fixed (257)")
        bad = [e for e in self.extensions if not e.startswith(".")]
        if not self.extensions or bad:
            raise config_error(f"{path}.extensions", "expected file endings like '.py'",
                               list(self.extensions))

    @property
    def bpe_vocab_size(self) -> int:
        return self.vocab_size or 4096

    def to_dict(self) -> dict:
        out = to_plain(self)
        if not self.sources:  # as datasets prepared before the key existed recorded it
            out.pop("sources")
        return out


NAMED_SOURCES = ("stdlib", "purelib")  # sysconfig path names


def resolve_source(name: Optional[str]) -> Path:
    """A folder, "stdlib" or "purelib" (None: "stdlib"), as an existing folder."""
    name = name or "stdlib"
    root = Path(sysconfig.get_paths()[name]) if name in NAMED_SOURCES else Path(name)
    if not root.is_dir():
        raise FileNotFoundError(f"data source {root}: not a folder")
    return root.resolve()


def list_files(root: Path, spec: CorpusSpec) -> List[Path]:
    """Matching files in a fixed order: top-level files first, then sub-folders, by path.

    Top-level first so that a small cap takes a cross-section of ordinary modules rather than
    whichever package sorts first.
    """
    exclude = set(spec.exclude_dirs)
    files = [p for p in root.rglob("*")
             if p.is_file() and p.name.endswith(spec.extensions)
             and not exclude.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: (len(p.relative_to(root).parts) > 1,
                                        p.relative_to(root).as_posix()))


def validation_files(names: List[str], sizes: List[int], fraction: float) -> List[bool]:
    """Whole files for validation, about `fraction` of the bytes, chosen in the order of a hash of
    their paths: deterministic, spread over the whole corpus, and never every file."""
    by_hash = sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).digest())
    target, held = fraction * sum(sizes), 0
    val = [False] * len(names)
    for i in by_hash[:-1]:  # the last file in hash order always stays in training
        if held >= target:
            break
        val[i], held = True, held + sizes[i]
    return val


@dataclass(frozen=True)
class Corpus:
    """Documents (one per file) of each split; validation files are never seen in training."""

    root: Path
    train: List[bytes]
    val: List[bytes]
    val_names: List[str]
    roots: Tuple[Path, ...] = ()  # every source folder read, in order
    digest: str = ""  # sha256 over the names and bytes taken, in order: what the text was
    skipped_copies: int = 0  # files left out because an earlier file had the same bytes


def _named_files(spec: CorpusSpec) -> Tuple[List[Tuple[str, Path]], Tuple[Path, ...]]:
    """(name, path) of every matching file of every source, sources in order; names carry the
    source's label when there are several."""
    labels = list(spec.sources) or [spec.source]
    roots = tuple(resolve_source(label) for label in labels)
    named = []
    for label, root in zip(labels, roots):
        prefix = f"{label}/" if spec.sources else ""
        named += [(prefix + p.relative_to(root).as_posix(), p) for p in list_files(root, spec)]
    return named, roots


def take_files(named: List[Tuple[str, Path]], max_bytes: int, unique: bool
               ) -> Tuple[List[Tuple[str, bytes]], int, str]:
    """Non-empty files in order until the next would pass max_bytes (always at least one);
    `unique`: skipping a file whose bytes an earlier one had. (taken, skipped copies, sha256
    over the names and bytes taken, in order)."""
    seen, taken, total, skipped, digest = set(), [], 0, 0, hashlib.sha256()
    for name, path in named:
        data = path.read_bytes()
        if not data:
            continue
        key = hashlib.sha256(data).digest()
        if unique and key in seen:
            skipped += 1
            continue
        if taken and total + len(data) > max_bytes:
            break
        seen.add(key)
        taken.append((name, data))
        total += len(data)
        digest.update(name.encode() + b"\0" + key)
    return taken, skipped, digest.hexdigest()


def load_corpus(spec: CorpusSpec) -> Corpus:
    """Read, cap and split the source folders; errors say which folder and what was found."""
    named, roots = _named_files(spec)
    taken, skipped, digest = take_files(named, spec.max_bytes, unique=bool(spec.sources))
    if len(taken) < 2:
        raise FileNotFoundError(f"data source {', '.join(map(str, roots))}: found {len(taken)} non-empty "
                                f"file(s) ending in {', '.join(spec.extensions)}; need at least 2 for a "
                                "train/validation split")
    names = [n for n, _ in taken]
    val = validation_files(names, [len(d) for _, d in taken], spec.val_fraction)
    return Corpus(roots[0], [d for (_, d), v in zip(taken, val) if not v],
                  [d for (_, d), v in zip(taken, val) if v], [n for n, v in zip(names, val) if v],
                  roots, digest, skipped)
