"""Reading a checkpoint without an engine or a process group: inspect it, export the model.

`hybrid-ray checkpoint inspect|export` (hybrid_ray/checkpoint_cli.py) call these. The export
reassembles the model's `state_dict` from every rank's files: parameters from their fp32 masters
(in the chosen dtype), tied names as copies of their first name, buffers and frozen parameters
from rank 0's module extras; so it loads into the plain `nn.Module` with `load_state_dict`.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import client_state
from . import storage as cio
from . import read as cread
from .state import meta_problem, rng_problem
from .storage import CheckpointError

Tensors = Dict[str, torch.Tensor]

def locate(path_or_uri: str, tag: Optional[str] = None) -> Tuple[object, str, List[str]]:
    """(filesystem, root, tags): PATH is one checkpoint directory (tags = [its name]) or a save
    directory (tags = [tag] if given, else every committed or staging checkpoint in it)."""
    fs, path = cio.filesystem(path_or_uri)
    if not cio.is_dir(fs, path):
        raise CheckpointError(f"{path_or_uri}: no such directory")
    if tag is None and cio.exists(fs, cio.join(path, cread.MANIFEST)):
        root, _, name = path.rpartition("/")
        return fs, root, [name]
    if tag is not None:
        return fs, path, [tag]
    return fs, path, sorted(cio.list_dirs(fs, path))


@dataclass
class Report:
    """What `inspect` found about one checkpoint directory."""

    tag: str
    committed: bool
    meta: dict = field(default_factory=dict)
    files: Dict[str, Tuple[int, str]] = field(default_factory=dict)  # name -> (bytes, status)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.committed and self.error is None and all(s == "ok" for _, s in self.files.values())


def inspect(fs, root: str, tag: str, verify: bool = True) -> Report:
    """Status of every file of one checkpoint: ok, missing, size or sha256 mismatch, or does not
    parse (sizes only when verify is False; meta.json is always read)."""
    ckpt = cio.join(root, tag)
    try:
        manifest = cread.read_manifest(fs, ckpt)
    except CheckpointError as e:
        sizes = cio.file_sizes(fs, ckpt)
        return Report(tag, False, files={n: (b, "not committed") for n, b in sizes.items()}, error=str(e))
    report = Report(tag, True)
    sizes = cio.file_sizes(fs, ckpt)
    for name, entry in sorted(manifest["files"].items()):
        size = sizes.get(name)
        status = "missing" if size is None else "ok" if size == entry["bytes"] else \
            f"size mismatch (manifest: {entry['bytes']})"
        if status == "ok" and (verify or name == cread.META):
            status = _content_status(fs, ckpt, name, entry, report)
        report.files[name] = (entry["bytes"] if size is None else size, status)
    return report


def _content_status(fs, ckpt: str, name: str, entry: dict, report: Report) -> str:
    """'ok', 'sha256 mismatch' or 'does not parse: ...' for one file of the size it should have;
    a good meta.json becomes report.meta, a bad one report.error."""
    data = cio.read_bytes(fs, cio.join(ckpt, name))
    if cio.sha256(data) != entry["sha256"]:
        return "sha256 mismatch"
    try:
        if name.endswith(".json"):
            value = cread.parse_json(data, ckpt, name)
            problem = meta_problem(value) if name == cread.META else \
                rng_problem(value) if name.startswith("rng-rank") else None
            if problem:
                raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name}: {problem}")
            if name == cread.META:
                report.meta = value
        elif name == client_state.FILE:
            client_state.parse(data, ckpt)
        else:
            cread.parse_tensors(data, ckpt, name)
    except CheckpointError as e:
        report.error = report.error or str(e)
        return "does not parse"
    return "ok"


def _meta_and_tensors(fs, ckpt: str, dtype: torch.dtype) -> Tuple[dict, Tensors, Tensors]:
    """(meta, {param name: master in dtype}, module extras), file by file, every file verified."""
    manifest, small = cread.read_json_files(fs, ckpt)
    masters: Dict[str, torch.Tensor] = {}
    extras: Dict[str, torch.Tensor] = {}
    names = [n for n in sorted(manifest["files"]) if n.startswith((cread.PARAMS, cread.EXTRAS))]
    for name, data in cread.iter_verified(fs, ckpt, manifest, names):
        tensors = cio.tensors_from_bytes(data, name)
        if name.startswith(cread.EXTRAS):
            extras.update(tensors)
            continue
        for key, value in tensors.items():  # keep the masters, drop optimizer state at once
            param, _, what = key.rpartition("/")
            if what == "master":
                masters[param] = value.to(dtype)
    return cio.json_from_bytes(small[cread.META]), masters, extras


def consolidated_state_dict(fs, ckpt: str, dtype: torch.dtype = torch.float32,
                            exclude_frozen: bool = False) -> Dict[str, torch.Tensor]:
    """The model's state_dict from a checkpoint's files: what `module.state_dict()` holds
    (without the frozen parameters with exclude_frozen; buffers are always kept)."""
    meta, masters, extras = _meta_and_tensors(fs, ckpt, dtype)
    layout = meta.get("module") or {"state_dict_keys": sorted(masters), "aliases": {}, "buffers": []}
    aliases, buffers = layout["aliases"], set(layout["buffers"])
    out: Dict[str, torch.Tensor] = {}
    for key in layout["state_dict_keys"]:
        name = aliases.get(key, key)
        if name in masters:
            out[key] = masters[name]
        elif key in extras:  # buffers keep their dtype; frozen parameters follow the export's
            if exclude_frozen and key not in buffers:
                continue
            value = extras[key]
            out[key] = value if key in buffers or not value.is_floating_point() else value.to(dtype)
        else:
            raise CheckpointError(f"checkpoint {ckpt} has no tensor for state_dict key {key!r}")
    return out


def state_dict_keys(root_uri: str) -> Optional[List[str]]:
    """The model's state_dict keys in the checkpoint a load under root would try first, from
    its manifest and meta alone (target() would read and hash every tensor file to choose,
    which the load that follows does anyway); None when there is no checkpoint there."""
    fs, root = cio.filesystem(root_uri)
    first = cread.preferred(fs, root) if cio.is_dir(fs, root) else None
    if first is None:
        return None
    _, small = cread.read_json_files(fs, cio.join(root, first.name))
    meta = cio.json_from_bytes(small[cread.META])
    layout = meta.get("module") or {}
    return list(layout.get("state_dict_keys") or [e["name"] for e in meta.get("params", [])])


def target(path_or_uri: str, tag: Optional[str]) -> Tuple[object, str]:
    """(filesystem, checkpoint directory): PATH itself when it is one, else the tag under it, or
    the one `latest` names with the usual fallback to the newest good one."""
    fs, path = cio.filesystem(path_or_uri)
    if tag is None and cio.exists(fs, cio.join(path, cread.MANIFEST)):
        return fs, path
    chosen = cread.choose(fs, path, tag)
    if chosen is None:
        raise CheckpointError(f"{path_or_uri}: no checkpoint" + (f" {tag!r}" if tag else "") + " to export")
    return fs, cio.join(path, chosen)


def export(path_or_uri: str, out: str, dtype: torch.dtype = torch.float32,
           tag: Optional[str] = None,
           transform: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None,
           ) -> Tuple[str, Dict[str, torch.Tensor]]:
    """Write the consolidated state_dict to OUT (.safetensors or .pt, path or URI), after
    `transform` when given (e.g. renaming a pipelined model's keys); returns (the checkpoint
    exported, the state_dict written)."""
    suffix = out.rsplit(".", 1)[-1] if "." in out else ""
    if suffix not in ("safetensors", "pt"):
        raise CheckpointError(f"{out}: the output must end in .safetensors or .pt")
    fs, ckpt = target(path_or_uri, tag)
    state = consolidated_state_dict(fs, ckpt, dtype)
    if transform is not None:
        state = transform(state)
    out_fs, out_path = cio.filesystem(out)
    cio.write_bytes(out_fs, out_path, _serialise(state, suffix, ckpt.rpartition("/")[2]))
    return ckpt, state


def _serialise(state: Dict[str, torch.Tensor], suffix: str, tag: str) -> bytes:
    if suffix == "pt":
        buf = io.BytesIO()
        torch.save(state, buf)  # tied names share storage, as in module.state_dict()
        return buf.getvalue()
    import safetensors.torch  # a dependency; imported here so inspect does not need it
    seen: set = set()
    unshared = {}
    for key, value in state.items():  # safetensors refuses tensors that share memory
        unshared[key] = value.clone() if id(value) in seen else value.contiguous()
        seen.add(id(value))
    return safetensors.torch.save(unshared, metadata={"format": "pt", "hybrid_ray_checkpoint": tag})
