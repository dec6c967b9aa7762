"""A byte-level language-modelling corpus that every machine with Python has offline.

The corpus is the Python standard library's own `.py` sources: real text (code, docstrings,
comments), identical on every machine with the same Python version, and no download. Tokens are
raw bytes (vocabulary 256), so there is no tokenizer to train or ship. This is a stand-in: the
Arrow datasets and BPE tokenizer of a later issue replace it.
"""
from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256
# Third-party packages live under the stdlib folder too; the test suite is huge and repetitive;
# encodings/ (codec tables) and pydoc_data/ (one giant string) are data rather than code.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
              "pydoc_data"}


@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation bytes; validation is whole held-out files, never seen in training."""

    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    train_files: int
    val_files: int
    root: str

    def describe(self) -> str:
        return (f"{self.train_files + self.val_files} stdlib .py files from {self.root}: "
                f"train {self.train.numel() / 1e6:.2f} MB, "
                f"val {self.val.numel() / 1e6:.2f} MB ({self.val_files} held-out files)")


def stdlib_sources(root: Optional[Path] = None) -> List[Path]:
    """The standard library's .py files in a fixed order: top-level modules, then packages.

    Top-level modules first (about 4-5 MB, more than the usual cap), so the held-out last files
    are ordinary modules on every Python version rather than whatever package sorts last.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: (len(p.relative_to(root).parts) > 1,
                                        p.relative_to(root).as_posix()))


def _take_until(files: List[Path], max_bytes: int) -> List[Tuple[Path, bytes]]:
    """Files in order until the next one would pass max_bytes (always at least one file)."""
    taken: List[Tuple[Path, bytes]] = []
    total = 0
    for path in files:
        data = path.read_bytes()
        if taken and total + len(data) > max_bytes:
            break
        taken.append((path, data))
        total += len(data)
    return taken


def load_corpus(max_bytes: int, val_fraction: float, root: Optional[Path] = None) -> ByteCorpus:
    """Read up to max_bytes of stdlib sources; the last val_fraction of the files is validation."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    taken = _take_until(stdlib_sources(root), max_bytes)
    if len(taken) < 2:
        raise RuntimeError(f"{root}: found {len(taken)} .py files; need at least 2 for a "
                           "train/validation split (is the Python standard library installed?)")
    n_val = min(len(taken) - 1, max(1, round(len(taken) * val_fraction)))
    split = len(taken) - n_val

    def to_tensor(parts: List[Tuple[Path, bytes]]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(d for _, d in parts)), dtype=torch.uint8)

    return ByteCorpus(to_tensor(taken[:split]), to_tensor(taken[split:]), split, n_val, str(root))


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy of the byte frequencies in nats/token: the loss of the best context-free model.

    Fitted on the very bytes it scores, so it is a lower bound for any unigram model; a language
    model that beats it has learned something from context.
    """
    counts = torch.bincount(tokens.long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class ByteWindows(Dataset):
    """Non-overlapping windows of seq_len bytes; item i is (input, target shifted by one)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"seq_len {seq_len}: longer than the corpus ({tokens.numel()} bytes)")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        lo = i * self.seq_len
        chunk = self.tokens[lo:lo + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def evenly_spaced(n: int, count: Optional[int]) -> List[int]:
    """count indices spread over range(n) (all of them when count is None or >= n)."""
    if count is None or count >= n:
        return list(range(n))
    step = n / count
    return [min(n - 1, math.floor(i * step)) for i in range(count)]
