"""Finding and verifying committed checkpoints (no engine, no process group).

A checkpoint directory is committed when its manifest.json parses and has our format; it is good
when every file the manifest lists has the recorded size (cheap: one listing) and, when read,
the recorded sha256. Used by loading, retention and the offline tools.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from . import storage as cio
from .storage import CheckpointError

log = logging.getLogger("hybrid_ray")
FORMAT = "hybrid_ray.checkpoint/1"
LATEST = "latest"
MANIFEST = "manifest.json"
META = "meta.json"
STAGING = ".tmp-"  # in the name of a directory (or `latest` file) still being written
PARAMS = "params-rank"  # + rank and part: per-parameter state
EXTRAS = "module-extras"  # + part: rank 0's buffers and frozen parameters


@dataclass(frozen=True)
class Committed:
    """A checkpoint directory with a manifest: its tag, saved step and manifest."""

    tag: str
    step: int
    manifest: dict


def read_manifest(fs, ckpt: str) -> dict:
    try:
        manifest = cio.json_from_bytes(cio.read_bytes(fs, cio.join(ckpt, MANIFEST)))
    except (OSError, FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete or corrupt: {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"checkpoint {ckpt}: unknown format {got!r}")
    return manifest


def iter_verified(fs, ckpt: str, manifest: dict, names: Optional[List[str]] = None
                  ) -> Iterator[Tuple[str, bytes]]:
    """(name, bytes) of the manifest's files (or `names` of them), each checked against its
    sha256 before it is yielded; one file in memory at a time."""
    files = manifest["files"]
    for name in sorted(files) if names is None else names:
        entry = files[name]
        try:
            data = cio.read_bytes(fs, cio.join(ckpt, name))
        except (OSError, FileNotFoundError) as e:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} is missing ({e})") from None
        if len(data) != entry["bytes"] or cio.sha256(data) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} fails its sha256 check "
                                  f"({len(data)} bytes, manifest says {entry['bytes']})")
        yield name, data


def verify(fs, ckpt: str) -> dict:
    """The manifest of a checkpoint whose every file passes its checksum; CheckpointError if not."""
    manifest = read_manifest(fs, ckpt)
    for _ in iter_verified(fs, ckpt, manifest):
        pass
    return manifest


def sizes_match(fs, ckpt: str, manifest: dict) -> bool:
    """Every listed file present with its recorded size (catches truncation without reading)."""
    sizes = cio.file_sizes(fs, ckpt)
    return all(sizes.get(name) == entry["bytes"] for name, entry in manifest["files"].items())


def committed(fs, root: str) -> List[Committed]:
    """Checkpoints with a readable manifest under root, newest (by saved step) first."""
    found = []
    for name in cio.list_dirs(fs, root):
        if STAGING in name:
            continue
        try:
            manifest = read_manifest(fs, cio.join(root, name))
        except CheckpointError:
            continue
        found.append(Committed(name, int(manifest.get("global_steps", -1)), manifest))
    return sorted(found, key=lambda c: (c.step, c.tag), reverse=True)


def latest_tag(fs, root: str) -> Optional[str]:
    return cio.read_text(fs, cio.join(root, LATEST))


def choose(fs, root: str, tag: Optional[str]) -> Optional[str]:
    """The tag to load: `tag` if it verifies (CheckpointError if not; None if absent), else the
    one `latest` names, falling back to the newest good one with a warning."""
    if tag is not None:
        ckpt = cio.join(root, str(tag))
        if not cio.is_dir(fs, ckpt):
            log.warning("no checkpoint %s: nothing loaded", ckpt)
            return None
        verify(fs, ckpt)
        return str(tag)
    latest = latest_tag(fs, root)
    order = [c.tag for c in committed(fs, root)]
    if latest is not None:
        order = [latest] + [t for t in order if t != latest]
    for i, name in enumerate(order):
        try:
            verify(fs, cio.join(root, name))
        except CheckpointError as e:
            log.warning("%s; trying an older checkpoint", e)
            continue
        if i > 0:
            log.warning("loading checkpoint %s instead of %s (latest)", name, order[0])
        return name
    if order:
        raise CheckpointError(f"no loadable checkpoint under {root}: every candidate is corrupt "
                              f"({', '.join(order)})")
    return None


def read_json_files(fs, ckpt: str) -> Tuple[dict, Dict[str, bytes]]:
    """(manifest, {name: bytes} of its verified JSON files: meta, RNG states). The tensor files
    are left to the caller's `iter_verified`, so that only one is in memory at a time."""
    manifest = read_manifest(fs, ckpt)
    small = [n for n in manifest["files"] if n.endswith(".json")]
    files = dict(iter_verified(fs, ckpt, manifest, small))
    if META not in files:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: the manifest lists no {META}")
    return manifest, files
