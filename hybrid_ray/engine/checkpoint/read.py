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


DISPLACED = ".old"  # suffix of a staging name: the previous copy of a tag being re-saved
_KIND_ORDER = {"final": 0, "staged": 1, "displaced": 2}
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Committed:
    """A complete checkpoint on storage: its tag, saved step and manifest, and the directory under
    the root that holds it: `tag` itself ("final"), or, when a commit was cut short, the save's
    staging directory with its manifest written ("staged") or the previous copy of a re-saved tag
    moved aside ("displaced")."""

    tag: str
    step: int
    manifest: dict
    dirname: str = ""
    kind: str = "final"

    @property
    def name(self) -> str:
        return self.dirname or self.tag


def staging_name(tag: str, token: str) -> str:
    return f"{tag}{STAGING}{token}"


def displaced_name(tag: str, token: str) -> str:
    return f"{tag}{STAGING}{token}{DISPLACED}"


def _problem(manifest: object) -> Optional[str]:
    """What is wrong with a parsed manifest, None if nothing (every field a reader relies on)."""
    if not isinstance(manifest, dict):
        return f"not a JSON object but {type(manifest).__name__}"
    if manifest.get("format") != FORMAT:
        return f"unknown format {manifest.get('format')!r}"
    steps = manifest.get("global_steps")
    if not isinstance(manifest.get("tag"), str) or not manifest["tag"]:
        return f"tag is {manifest.get('tag')!r}, not a name"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return f"global_steps is {steps!r}, not a step number"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "it lists no files" if not files else f"files is a {type(files).__name__}, not an object"
    for name, entry in files.items():
        if not safe_name(name):
            return f"file name {name!r} is not a plain name in the checkpoint's directory"
        if not isinstance(entry, dict) or not _is_digest(entry.get("sha256")) or \
                isinstance(entry.get("bytes"), bool) or not isinstance(entry.get("bytes"), int) \
                or entry["bytes"] < 0:
            return f"the entry of {name} is not {{sha256, bytes}}: {entry!r:.80}"
    return None


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def safe_name(name: object) -> bool:
    """A plain file or tag name: nothing that could point outside the directory it is read from."""
    return isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..") and \
        not any(c in name for c in "/\\\0")


def read_manifest(fs, ckpt: str) -> dict:
    """The checkpoint's manifest, checked field by field; CheckpointError naming what is wrong."""
    try:
        manifest = cio.json_from_bytes(cio.read_bytes(fs, cio.join(ckpt, MANIFEST)))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"checkpoint {ckpt} is incomplete or corrupt: {MANIFEST}: {e}") from None
    problem = _problem(manifest)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {MANIFEST}: {problem}")
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
        except OSError as e:
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


def complete(fs, ckpt: str) -> dict:
    """The manifest of a checkpoint whose every file is present at its recorded size (one
    listing; the checksums are left to whoever reads the files); CheckpointError if not."""
    manifest = read_manifest(fs, ckpt)
    sizes = cio.file_sizes(fs, ckpt)
    for name, entry in sorted(manifest["files"].items()):
        if sizes.get(name) is None:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} is missing")
        if sizes[name] != entry["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} has {sizes[name]} bytes, "
                                  f"the manifest says {entry['bytes']}")
    return manifest


def sizes_match(fs, ckpt: str, manifest: dict) -> bool:
    """Every listed file present with its recorded size (catches truncation without reading)."""
    sizes = cio.file_sizes(fs, ckpt)
    return all(sizes.get(name) == entry["bytes"] for name, entry in manifest["files"].items())


def tag_of(name: str) -> str:
    """The tag of a directory name under a root (a staged or displaced copy's too)."""
    return _classify(name)[0]


def _classify(name: str) -> Tuple[str, str, str]:
    """(tag, kind, token) of a directory name under a root."""
    tag, sep, rest = name.partition(STAGING)
    if not sep:
        return name, "final", ""
    if rest.endswith(DISPLACED):
        return tag, "displaced", rest[:-len(DISPLACED)]
    return tag, "staged", rest


def scan(fs, root: str) -> Tuple[List[Committed], List[Tuple[str, str]]]:
    """(complete checkpoints, newest step first; [(directory, what is wrong)] of the directories
    that are not). A save's staging directory without its manifest is a save in progress or cut
    short, not a fault, and a directory without any manifest is not ours: neither is listed."""
    found: List[Committed] = []
    bad: List[Tuple[str, str]] = []
    for name in cio.list_dirs(fs, root):
        tag, kind, token = _classify(name)
        path = cio.join(root, name)
        if not cio.exists(fs, cio.join(path, MANIFEST)):
            continue
        try:
            manifest = read_manifest(fs, path)
        except CheckpointError as e:
            bad.append((name, str(e)))
            continue
        if kind != "final" and (manifest["tag"] != tag or
                                (kind == "staged" and manifest.get("token") != token)):
            continue  # a staging directory holding some other save's manifest: not complete
        found.append(Committed(tag, manifest["global_steps"], manifest, name, kind))
    found.sort(key=lambda c: (-c.step, c.tag, _KIND_ORDER[c.kind]))
    return found, bad


def committed(fs, root: str) -> List[Committed]:
    """Complete checkpoints under root, newest (by saved step) first."""
    return scan(fs, root)[0]


def latest_tag(fs, root: str) -> Optional[str]:
    """The tag `latest` names; None when it is absent or unusable (not UTF-8, empty, a path)."""
    return read_latest(fs, root)[0]


def read_latest(fs, root: str) -> Tuple[Optional[str], Optional[str]]:
    """(tag `latest` names or None, what is wrong with the file or None)."""
    path = cio.join(root, LATEST)
    try:
        if not cio.exists(fs, path):
            return None, None
        text = cio.read_bytes(fs, path).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path} is unreadable ({e})"
    if not safe_name(text) or STAGING in text:
        return None, f"{path} does not name a checkpoint ({text[:80]!r})"
    return text, None


def preferred(fs, root: str) -> Optional[Committed]:
    """The checkpoint a load without a tag will try first (`latest`'s, else the newest), from
    the manifests alone: cheap, for saying where a run resumes before it loads."""
    order = _order(committed(fs, root), latest_tag(fs, root))
    return order[0] if order else None


def _order(found: List[Committed], first: Optional[str]) -> List[Committed]:
    """Candidates to try: the copies of tag `first` (final, staged, displaced), then the rest,
    newest first."""
    head = [c for c in found if c.tag == first]
    head.sort(key=lambda c: _KIND_ORDER[c.kind])
    return head + [c for c in found if c.tag != first]


def choose(fs, root: str, tag: Optional[str], passed: Tuple[str, ...] = (), full: bool = True) -> Optional[str]:
    """The directory under root to load: tag `tag` if one of its copies verifies (CheckpointError
    if none does; None if it is absent), else the tag `latest` names, falling back to the newest
    good checkpoint with a warning. Garbage under root is skipped with a warning naming it, and so
    are the directories in `passed` (tried already and found unreadable).

    full=False checks each candidate's manifest and file sizes only (a listing, no read), for a
    caller that verifies every file's sha256 as it reads it and comes back with `passed` when
    one fails (the engine's load: reading a checkpoint twice doubled the time of a load)."""
    found, bad = scan(fs, root)
    found = [c for c in found if c.name not in passed]
    if tag is not None:
        copies = _order([c for c in found if c.tag == str(tag)], str(tag))
        if not copies and not cio.is_dir(fs, cio.join(root, str(tag))):
            log.warning("no checkpoint %s: nothing loaded", cio.join(root, str(tag)))
            return None
        if not copies:
            read_manifest(fs, cio.join(root, str(tag)))  # raises: what is wrong with it
        return _first_good(fs, root, copies, strict=True, full=full)
    for name, problem in ([] if passed else bad):  # warned once, on the first try
        log.warning("skipping %s: %s", cio.join(root, name), problem)
    latest, problem = read_latest(fs, root)
    if problem and not passed:
        log.warning("%s; choosing the newest good checkpoint", problem)
    order = _order(found, latest)
    if latest is not None and not passed and (not order or order[0].tag != latest):
        log.warning("%s names %s, which is not a complete checkpoint", cio.join(root, LATEST), latest)
    chosen = _first_good(fs, root, order, strict=False, latest=latest, full=full)
    listed = [c.name for c in order] + [name for name, _ in bad] + list(passed)
    if chosen is None and listed:
        raise CheckpointError(f"no loadable checkpoint under {root}: every candidate is corrupt "
                              f"({', '.join(listed)})")
    if chosen is None and latest is not None:  # progress was saved here once: never start over
        raise CheckpointError(f"no loadable checkpoint under {root}: {LATEST} names {latest}, "
                              "which is not a complete checkpoint, and there is no other")
    return chosen


def _first_good(fs, root: str, order: List[Committed], strict: bool,
                latest: Optional[str] = None, full: bool = True) -> Optional[str]:
    """The first candidate whose files verify (full) or are all there at their sizes; a warning
    for each one passed over."""
    for i, c in enumerate(order):
        try:
            (verify if full else complete)(fs, cio.join(root, c.name))
        except CheckpointError as e:
            if strict and i == len(order) - 1:
                raise
            log.warning("%s; trying an older checkpoint", e)
            continue
        if i > 0 or c.kind != "final":
            log.warning("loading checkpoint %s instead of %s%s", c.name, order[0].tag,
                        " (latest)" if order[0].tag == latest else "")
        return c.name
    return None


def parse_tensors(data: bytes, ckpt: str, name: str) -> Dict[str, "torch.Tensor"]:
    """A verified tensor file's tensors; CheckpointError naming it if it does not parse (a file
    can pass its checksum and still be garbage: the manifest was written for it)."""
    try:
        return cio.tensors_from_bytes(data, name)
    except Exception as e:  # noqa: BLE001 - safetensors, torch.load (weights only) and pickle raise many types
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} does not parse as tensors "
                              f"({type(e).__name__}: {str(e)[:200]})") from None


def parse_json(data: bytes, ckpt: str, name: str) -> dict:
    try:
        value = cio.json_from_bytes(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} holds a "
                              f"{type(value).__name__}, not an object")
    return value


def read_json_files(fs, ckpt: str) -> Tuple[dict, Dict[str, bytes]]:
    """(manifest, {name: bytes} of its verified JSON files: meta, RNG states). The tensor files
    are left to the caller's `iter_verified`, so that only one is in memory at a time."""
    manifest = read_manifest(fs, ckpt)
    small = [n for n in manifest["files"] if n.endswith(".json")]
    files = dict(iter_verified(fs, ckpt, manifest, small))
    if META not in files:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: the manifest lists no {META}")
    return manifest, files
