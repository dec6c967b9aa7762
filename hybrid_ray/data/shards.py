"""Token shards as Arrow IPC files, read memory-mapped, served as fixed-length windows.

A split is a stream of token ids cut into shards of about `shard_tokens` tokens. Each shard is
one uncompressed Arrow IPC file holding one record batch with one column, `tokens` (uint16 when
the vocabulary fits, else uint32). Uncompressed IPC is the layout Arrow can memory-map: a
shard's tokens are then a numpy view of the page cache, so a dataset of any size costs almost no
RAM and every DataLoader worker shares the same pages. (Parquet is encoded and compressed: it
must be decoded into memory, so it is not used here.)

Windows: with sequence length L, shard s holds (n_s - 1) // L windows; window j is its tokens
[j*L, j*L + L + 1) (input = first L, target = last L, overlapping the next window by one token).
Windows never cross shards. The global sample index runs over the windows of all shards in order.

Paths may be local or any URI pyarrow.fs understands (s3://, gs://, hdfs://, file://). A remote
shard is copied once into a local cache directory when first read, then memory-mapped like a
local one.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch
from torch.utils.data import Dataset

from hybrid_ray.config.paths import is_uri

COLUMN = "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def resolve(path_or_uri: str, filesystem: Optional[pafs.FileSystem] = None) -> Tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI."""
    if filesystem is not None:
        return filesystem, path_or_uri
    if is_uri(path_or_uri):
        return pafs.FileSystem.from_uri(path_or_uri)
    return pafs.LocalFileSystem(), os.path.abspath(path_or_uri)


def write_shard(fs: pafs.FileSystem, path: str, tokens: np.ndarray) -> None:
    """One shard: one uncompressed record batch, so the reader can memory-map it. The token count
    also goes in the schema's metadata, which sits in the footer: counting needs no data read."""
    schema = pa.schema([(COLUMN, pa.from_numpy_dtype(tokens.dtype))],
                       metadata={"tokens": str(tokens.size)})
    batch = pa.record_batch([pa.array(tokens)], schema=schema)
    with fs.open_output_stream(path) as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


class ShardWriter:
    """Cuts a stream of token arrays into shards of `shard_tokens` tokens (the last one shorter)."""

    def __init__(self, fs: pafs.FileSystem, directory: str, shard_tokens: int, dtype: np.dtype):
        self.fs, self.directory, self.shard_tokens, self.dtype = fs, directory, shard_tokens, dtype
        self.shards: List[Dict[str, object]] = []
        self._pending: List[np.ndarray] = []
        self._pending_n = 0
        fs.create_dir(directory, recursive=True)

    def append(self, tokens: Sequence[int]) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._pending.append(arr)
        self._pending_n += arr.size
        while self._pending_n >= self.shard_tokens:
            flat = np.concatenate(self._pending)
            self._flush(flat[:self.shard_tokens])
            rest = flat[self.shard_tokens:]
            self._pending, self._pending_n = [rest], rest.size

    def close(self) -> List[Dict[str, object]]:
        """Write what is left; returns [{"name", "tokens"}] per shard, in order."""
        if self._pending_n:
            self._flush(np.concatenate(self._pending))
        self._pending, self._pending_n = [], 0
        return self.shards

    def _flush(self, tokens: np.ndarray) -> None:
        name = f"shard-{len(self.shards):05d}.arrow"
        write_shard(self.fs, f"{self.directory}/{name}", tokens)
        self.shards.append({"name": name, "tokens": int(tokens.size)})


@dataclass(frozen=True)
class ShardRef:
    """A shard's location and token count (known from meta.json, so nothing is opened early)."""

    path: str
    tokens: int


def read_shard_tokens(fs: pafs.FileSystem, path: str) -> int:
    """Token count of a shard from its footer (no token data read, even from remote storage)."""
    with fs.open_input_file(path) as f:
        metadata = pa.ipc.open_file(f).schema.metadata or {}
    if b"tokens" not in metadata:
        raise ValueError(f"{path}: not a token shard written by hybrid_ray (no token count in its "
                         "schema metadata)")
    return int(metadata[b"tokens"])


class TokenDataset(Dataset):
    """Fixed-length windows over token shards; item i is (input, target), int64, each seq_len long.

    Shards are opened lazily, on the first window read from them, and memory-mapped. Pickling
    (DataLoader workers started with spawn, Ray) sends only the shard list: each process maps the
    files itself.
    """

    def __init__(self, shards: Sequence[ShardRef], seq_len: int,
                 filesystem: Optional[pafs.FileSystem] = None, cache_dir: Optional[str] = None):
        if seq_len < 1:
            raise ValueError(f"seq_len {seq_len}: must be >= 1")
        self.shards, self.seq_len = list(shards), seq_len
        self.filesystem = filesystem or pafs.LocalFileSystem()
        self.cache_dir = cache_dir
        counts = np.array([max(0, (s.tokens - 1) // seq_len) for s in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        if self._starts[-1] == 0:
            total = sum(s.tokens for s in self.shards)
            raise ValueError(f"{len(self.shards)} shard(s) with {total} tokens hold no window of "
                             f"seq_len {seq_len} + 1 tokens")
        self._arrays: Dict[int, np.ndarray] = {}

    @classmethod
    def from_paths(cls, paths: Sequence[str], seq_len: int, **kwargs) -> "TokenDataset":
        """From shard paths or URIs alone (reads each file's footer to count its tokens)."""
        fs = kwargs.pop("filesystem", None)
        refs = []
        for p in paths:
            shard_fs, inner = resolve(p, fs)
            fs = fs or shard_fs
            refs.append(ShardRef(inner, read_shard_tokens(shard_fs, inner)))
        return cls(refs, seq_len, filesystem=fs, **kwargs)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        lo = (index - int(self._starts[shard])) * self.seq_len
        # astype copies the window out of the mapped file into an ordinary int64 array.
        chunk = torch.from_numpy(self.tokens(shard)[lo:lo + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def tokens(self, shard: int) -> np.ndarray:
        """The shard's tokens: a read-only numpy view of the memory-mapped file."""
        arr = self._arrays.get(shard)
        if arr is None:
            arr = self._arrays[shard] = _map_tokens(self._local_path(self.shards[shard].path))
        return arr

    def _local_path(self, path: str) -> str:
        if isinstance(self.filesystem, pafs.LocalFileSystem):
            return path
        return _cached_copy(self.filesystem, path, self.cache_dir)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_arrays"] = {}  # mappings are per process
        return state


def _map_tokens(local_path: str) -> np.ndarray:
    reader = pa.ipc.open_file(pa.memory_map(local_path, "r"))
    if reader.num_record_batches != 1 or reader.schema.names != [COLUMN]:
        raise ValueError(f"{local_path}: not a token shard (want one record batch with one column "
                         f"'{COLUMN}'; got {reader.num_record_batches} batches, columns "
                         f"{reader.schema.names})")
    # zero_copy_only: fail rather than silently read the shard into memory.
    return reader.get_batch(0).column(0).to_numpy(zero_copy_only=True)


def _cached_copy(fs: pafs.FileSystem, path: str, cache_dir: Optional[str]) -> str:
    """Copy a remote shard into the local cache once; concurrent readers race harmlessly."""
    root = Path(cache_dir or Path.home() / ".cache" / "hybrid_ray" / "shards")
    key = hashlib.sha256(f"{fs.type_name}:{path}".encode()).hexdigest()[:24]
    local = root / f"{key}-{Path(path).name}"
    if not local.exists():
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".part")
        os.close(fd)
        try:
            pafs.copy_files(path, tmp, source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
            os.replace(tmp, local)  # atomic: a reader never maps a half-copied file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return str(local)
