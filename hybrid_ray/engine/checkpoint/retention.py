"""Which old checkpoints to delete after a commit (`checkpoint.keep_last`, `keep_every`).

The decision is a pure function of what is on storage, so it is tested without files. Rules:
keep the newest `keep_last` good checkpoints (good: committed, every file at its recorded size),
every checkpoint whose step is a multiple of `keep_every`, and the one `latest` names. A corrupt
checkpoint never counts towards keep_last, so the newest good one is never deleted. Directories
without a manifest other than our own staging leftovers are not ours to judge and are left alone.
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


def stale_staging(fs, root: str) -> List[str]:
    """Paths a killed or failed save left behind under root (directories and `latest` temps).

    Saves into one root are serialised (a save starts only after the previous one finished on
    every rank), so when a commit has just finished every staging name belongs to a dead save.
    """
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return [i.path for i in infos if cread.STAGING in i.base_name]


def apply(fs, root: str, keep_last: Optional[int], keep_every: Optional[int]) -> List[str]:
    """Delete stale staging paths and, with keep_last, the checkpoints `to_delete` names.

    Runs on rank 0 right after a commit; a failure is logged, not raised: the new checkpoint is
    committed already. Returns the deleted tags.
    """
    deleted: List[str] = []
    try:
        for path in stale_staging(fs, root):
            _delete(fs, path)
        if keep_last is None:
            return deleted
        found = [Candidate(c.tag, c.step, cread.sizes_match(fs, cio.join(root, c.tag), c.manifest))
                 for c in cread.committed(fs, root)]
        for tag in to_delete(found, cread.latest_tag(fs, root), keep_last, keep_every):
            fs.delete_dir(cio.join(root, tag))
            deleted.append(tag)
    except (OSError, ValueError) as e:
        log.warning("checkpoint retention under %s stopped: %s", root, e)
    if deleted:
        log.info("checkpoint retention: deleted %s", ", ".join(deleted))
    return deleted


def _delete(fs, path: str) -> None:
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)
    else:
        fs.delete_file(path)
