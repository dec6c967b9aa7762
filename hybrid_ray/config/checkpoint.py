"""The `checkpoint` section (ours, not DeepSpeed's): asynchronous saves and retention."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybrid_ray.config.errors import config_error
from hybrid_ray.config.loader import checked


@dataclass(frozen=True)
class CheckpointConfig:
    """How `engine.save_checkpoint` writes and which older checkpoints it deletes."""

    async_save: bool = False
    """Copy the state to host memory, then write and commit it in a background thread
    (`save_checkpoint(..., async_save=...)` overrides it per call)."""
    keep_last: Optional[int] = checked(None, ge=1)
    """After each commit delete all but the newest `keep_last` good checkpoints under the save
    directory; None keeps every checkpoint."""
    keep_every: Optional[int] = checked(None, ge=1)
    """With keep_last: also keep every checkpoint whose step is a multiple of this."""
    commit_timeout_s: float = checked(1800.0, gt=0)
    """Seconds rank 0 waits for the other ranks' files before it gives up on a commit."""
    peer_timeout_s: float = checked(20.0, gt=0)
    """Seconds without a heartbeat from another rank during a save before it is taken for dead
    and the save fails on the survivors (the heartbeat runs beside the writes, so slow storage
    does not trip it; a frozen process does)."""
    write_threads: int = checked(4, ge=1, le=64)
    """Files each rank serialises, checksums and writes at once."""
    fsync: bool = True
    """Flush local files to disk before the commit, so a power loss cannot leave a committed
    checkpoint with missing data (no effect on object stores)."""

    def validate(self, path: str) -> None:
        """keep_every alone would keep everything anyway: almost certainly a forgotten keep_last."""
        if self.keep_every is not None and self.keep_last is None:
            raise config_error(f"{path}.keep_every", "needs keep_last", self.keep_every,
                               f"set {path}.keep_last (without it every checkpoint is kept)")
