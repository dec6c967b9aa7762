"""Noticing, during a save, that another rank is gone: a heartbeat over the group's store.

The ranks of a save agree through files (write.py) and wait for each other's: a peer that died
would be waited for `commit_timeout_s` (30 minutes by default), and a peer's death is invisible
in the files. So while a save is in flight every rank bumps a counter in the process group's
key-value store once a second from a thread of its own (beside the writes: slow storage does
not stop it), and the waits check the others' counters: one that has not moved for
`checkpoint.peer_timeout_s` means that rank died or froze. When the store itself is gone (it
lives in rank 0's process unless torchrun's agent hosts it), the peer that hosted it is.
Counters are read with `add(key, 0)`: it never blocks, where `get` of a missing key would.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional

import torch.distributed as dist

from .storage import CheckpointError

INTERVAL_S = 1.0


def group_store() -> Optional[Any]:
    """The default process group's store, None when there is no group (or no store to reach)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class Heartbeat:
    """This rank's pulse for one save (keyed by its token), and its view of the others'."""

    def __init__(self, store: Any, token: str, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self._prefix = f"hybrid_ray/checkpoint/{token}/alive"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: Dict[int, int] = {}
        self._moved: Dict[int, float] = {}

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def start(self) -> None:
        self._beat()
        self._thread = threading.Thread(target=self._run, name="hybrid_ray-ckpt-heartbeat",
                                        daemon=True)  # never outlives the save: stop() joins it
        self._thread.start()

    def _beat(self) -> None:
        try:
            self.store.add(self._key(self.rank), 1)
        except Exception:  # noqa: BLE001 - the store went away: check() reports it
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:  # one key per rank and save would otherwise pile up in the store
                self.store.delete_key(self._key(self.rank))
            except Exception:  # noqa: BLE001 - the store is gone: nothing to tidy
                pass

    def check(self) -> None:
        """CheckpointError if a peer's counter has not moved for timeout_s or the store is gone."""
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                count = self.store.add(self._key(r), 0)
            except Exception as e:  # noqa: BLE001 - any store failure means its host is gone
                raise CheckpointError(f"rank {self.rank} lost the process group's store during "
                                      f"the save ({type(e).__name__}: {str(e)[:120]}): the rank "
                                      "that hosts it (rank 0 or the launcher) is gone") from None
            if self._seen.get(r) != count:
                self._seen[r], self._moved[r] = count, now
            elif now - self._moved[r] > self.timeout_s:
                raise CheckpointError(f"rank {r} stopped answering during the save: no heartbeat "
                                      f"for {self.timeout_s:g} s (checkpoint.peer_timeout_s); "
                                      "its process died or froze")
