"""Byte-level checkpoint storage through pyarrow.fs: local paths and URIs (s3://, gs://, ...).

Tensors are stored in safetensors when that package is importable, else as `torch.save` of a
flat dict of tensors, read back with `torch.load(weights_only=True)`: nothing arbitrary is ever
unpickled. Metadata is JSON.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Dict, Optional, Tuple

import torch

try:  # optional
    import safetensors.torch as _safetensors
except ImportError:  # pragma: no cover - depends on the environment
    _safetensors = None

TENSOR_EXT = ".safetensors" if _safetensors is not None else ".pt"


def filesystem(path_or_uri: str):
    """(pyarrow FileSystem, path inside it) for a plain local path or a URI."""
    import pyarrow.fs as pafs
    if "://" in str(path_or_uri):
        fs, path = pafs.FileSystem.from_uri(str(path_or_uri))
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(os.fspath(path_or_uri))


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bytes(fs, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def exists(fs, path: str) -> bool:
    import pyarrow.fs as pafs
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(fs, path: str) -> bool:
    import pyarrow.fs as pafs
    return fs.get_file_info(path).type == pafs.FileType.Directory


def list_dirs(fs, path: str):
    import pyarrow.fs as pafs
    if not is_dir(fs, path):
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return [i.base_name for i in infos if i.type == pafs.FileType.Directory]


def tensors_to_bytes(tensors: Dict[str, torch.Tensor]) -> bytes:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if _safetensors is not None:
        return _safetensors.save(tensors)
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def tensors_from_bytes(data: bytes, name: str) -> Dict[str, torch.Tensor]:
    if name.endswith(".safetensors"):
        if _safetensors is None:
            raise RuntimeError(f"{name}: reading it needs the safetensors package")
        return _safetensors.load(data)
    out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(out, dict) or not all(torch.is_tensor(v) for v in out.values()):
        raise ValueError(f"{name}: not a dict of tensors")
    return out


def json_bytes(obj) -> bytes:
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
    import pyarrow.fs as pafs
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
