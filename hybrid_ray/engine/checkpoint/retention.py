"""Which old checkpoints to delete after a commit (`checkpoint.keep_last`, `keep_every`).

The decision is a pure function of what is on storage, so it is tested without files. Rules:
keep the newest `keep_last` good checkpoints (good: committed, every file at its recorded size),
every checkpoint whose step is a multiple of `keep_every`, and the one `latest` names. A corrupt
checkpoint never counts towards keep_last, so the newest good one is never deleted. Directories
without a manifest other than our own staging leftovers are not ours to judge and are left alone.
Before any of that, `settle` finishes or clears what saves killed mid-commit left behind.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import pyarrow.fs as pafs

from . import storage as cio
from . import read as cread

log = logging.getLogger("hybrid_ray")


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint as retention sees it."""

    tag: str
    step: int
    good: bool


def to_delete(found: Sequence[Candidate], latest: Optional[str], keep_last: int,
              keep_every: Optional[int] = None) -> List[str]:
    """Tags to delete, oldest first."""
    newest_first = sorted(found, key=lambda c: (c.step, c.tag), reverse=True)
    keep = {c.tag for c in [c for c in newest_first if c.good][:keep_last]}
    if keep_every:
        keep |= {c.tag for c in found if c.step % keep_every == 0}
    if latest is not None:
        keep.add(latest)
    return [c.tag for c in reversed(newest_first) if c.tag not in keep]


def settle(fs, root: str) -> List[str]:
    """Finish what killed saves left under root; the paths it deleted.

    A tag whose own directory is missing but which has a complete copy (a commit cut short
    between moving the previous copy aside and moving the new one in) gets that copy moved into
    place, the one a reader would load: the new one over the displaced one. Every other staging
    path (directories, `latest` temporaries) then belongs to a dead save: saves into one root
    are serialised, so when a commit has just finished no other save is in flight.
    """
    found = cread.committed(fs, root)
    finals = {c.tag for c in found if c.kind == "final"}
    for c in found:  # sorted: a tag's staged copy comes before its displaced one
        if c.kind != "final" and c.tag not in finals:
            cio.move_dir(fs, cio.join(root, c.name), cio.join(root, c.tag))
            finals.add(c.tag)
            log.warning("checkpoint %s: completed a commit that was cut short (from %s)",
                        cio.join(root, c.tag), c.name)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    stale = [i.path for i in infos if cread.STAGING in i.base_name]
    for path in stale:
        _delete(fs, path)
    return stale


def apply(fs, root: str, keep_last: Optional[int], keep_every: Optional[int]) -> List[str]:
    """`settle` the root and, with keep_last, delete the checkpoints `to_delete` names.

    Runs on rank 0 right after a commit; nothing here raises (a failure is logged): the new
    checkpoint is committed already, and whatever else lies under the root is not this save's
    to fail on. Returns the deleted tags.
    """
    deleted: List[str] = []
    try:
        settle(fs, root)
        if keep_last is None:
            return deleted
        found = [Candidate(c.tag, c.step, cread.sizes_match(fs, cio.join(root, c.tag), c.manifest))
                 for c in cread.committed(fs, root) if c.kind == "final"]
        for tag in to_delete(found, cread.latest_tag(fs, root), keep_last, keep_every):
            fs.delete_dir(cio.join(root, tag))
            deleted.append(tag)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("checkpoint retention under %s stopped: %s: %s", root, type(e).__name__, e)
    if deleted:
        log.info("checkpoint retention: deleted %s", ", ".join(deleted))
    return deleted


def _delete(fs, path: str) -> None:
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)
    else:
        fs.delete_file(path)
