"""Byte-level checkpoint storage through pyarrow.fs: local paths and URIs (s3://, gs://, ...).

Tensors are stored in safetensors when that package is importable, else as `torch.save` of a
flat dict of tensors, read back with `torch.load(weights_only=True)`: nothing arbitrary is ever
unpickled. Metadata is JSON. Nothing here is collective: the background writer uses it too.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import struct
from typing import Dict, Optional, Tuple

import pyarrow.fs as pafs
import torch

from hybrid_ray.config.paths import is_uri

try:  # optional
    import safetensors.torch as _safetensors
except ImportError:  # pragma: no cover - depends on the environment
    _safetensors = None

TENSOR_EXT = ".safetensors" if _safetensors is not None else ".pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded (corrupt, incomplete, incompatible)."""


def filesystem(path_or_uri: str):
    """(pyarrow FileSystem, path inside it) for a plain local path or a URI."""
    if is_uri(path_or_uri):
        fs, path = pafs.FileSystem.from_uri(str(path_or_uri))
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(os.fspath(path_or_uri))


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bytes(fs, path: str, data: bytes, fsync: bool = False) -> None:
    """Write a whole file; with fsync, a local file's data reaches the disk before this returns
    (pyarrow.fs has no fsync; object stores make an object durable when its upload completes)."""
    with fs.open_output_stream(path) as f:
        f.write(data)
    if fsync and is_local(fs):
        fsync_path(path)


def write_atomic(fs, path: str, data: bytes) -> None:
    """Write under a temporary name, then move: a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    write_bytes(fs, tmp, data)
    fs.move(tmp, path)


def is_local(fs) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def file_sizes(fs, path: str) -> Dict[str, int]:
    """{file name: bytes} of the files directly inside a directory (one listing)."""
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}


def read_bytes(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def exists(fs, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(fs, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.Directory


def list_dirs(fs, path: str):
    if not is_dir(fs, path):
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return [i.base_name for i in infos if i.type == pafs.FileType.Directory]


def tensors_to_bytes(tensors: Dict[str, torch.Tensor]) -> bytes:
    # clone: torch.save writes a view's whole storage, and snapshot tensors are views of one buffer
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    if _safetensors is not None:
        return _safetensors.save(tensors)
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


# safetensors' own writer first builds the whole file as one bytes object (0.9 GB/s here, a
# second copy of the state in memory); checkpoints stream the format instead: an 8-byte length,
# a JSON header with each tensor's dtype, shape and byte range, then the raw bytes in that order
# (https://github.com/huggingface/safetensors#format). Reading goes through the library, which
# validates all of it.
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _safetensors_header(tensors: Dict[str, torch.Tensor]) -> bytes:
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as the library writes them
    return struct.pack("<Q", len(text)) + text


def write_tensors(fs, path: str, tensors: Dict[str, torch.Tensor], fsync: bool = False) -> Tuple[str, int]:
    """Write host tensors as one TENSOR_EXT file; (sha256, bytes) of what was written.

    With safetensors, streamed from the tensors' own memory (no serialised copy; sha256 and
    pyarrow's write release the GIL, so several files can be written at once).
    """
    if _safetensors is None or any(t.dtype not in _SAFETENSORS_DTYPES for t in tensors.values()):
        data = tensors_to_bytes(tensors)
        write_bytes(fs, path, data, fsync)
        return manifest_entry(data)
    digest, size = hashlib.sha256(), 0
    with fs.open_output_stream(path) as f:
        head = _safetensors_header(tensors)
        digest.update(head)
        f.write(head)
        size += len(head)
        for t in tensors.values():
            raw = memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            digest.update(raw)
            f.write(raw)
            size += raw.nbytes
    if fsync and is_local(fs):
        fsync_path(path)
    return digest.hexdigest(), size


def fsync_path(path: str) -> None:
    """os.fsync a local file or directory (a directory: so that renames in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tensors_from_bytes(data: bytes, name: str) -> Dict[str, torch.Tensor]:
    if name.endswith(".safetensors"):
        if _safetensors is None:
            raise RuntimeError(f"{name}: reading it needs the safetensors package")
        return _safetensors.load(data)
    out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(out, dict) or not all(torch.is_tensor(v) for v in out.values()):
        raise ValueError(f"{name}: not a dict of tensors")
    return out


def json_bytes(obj, compact: bool = False) -> bytes:
    """Indented for files people read; compact for bulk (json's C encoder runs only without indent)."""
    if compact:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def json_from_bytes(data: bytes) -> dict:
    return json.loads(data.decode())


def manifest_entry(data: bytes) -> Tuple[str, int]:
    return sha256(data), len(data)


def read_text(fs, path: str) -> Optional[str]:
    return read_bytes(fs, path).decode().strip() if exists(fs, path) else None


def copy_dir_manifest_last(fs, src: str, dst: str, last: str = "manifest.json") -> None:
    """Copy the files of src into dst with `last` copied last, then delete src (for stores
    without directory moves, e.g. S3: a reader trusts only a directory with a manifest)."""
    fs.create_dir(dst, recursive=True)
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(src)) if i.type == pafs.FileType.File]
    for name in sorted(names, key=lambda n: n == last):
        fs.copy_file(join(src, name), join(dst, name))
    fs.delete_dir(src)


def move_dir(fs, src: str, dst: str) -> None:
    """Rename a finished staging directory to its final name (copy, manifest last, if the
    filesystem cannot move directories)."""
    try:
        fs.move(src, dst)
    except (OSError, NotImplementedError):
        if exists(fs, dst):
            fs.delete_dir(dst)
        copy_dir_manifest_last(fs, src, dst)
