"""The buddy ring: every `copy_interval` steps each rank sends its snapshot to the next rank.

Rank r's buddy is rank r+1 (mod N): r sends its snapshot there and receives rank r-1's. The
exchange runs on a thread of its own over a gloo group of its own, so it overlaps the next
steps' compute and never mixes with the training thread's collectives; the training thread
only copies its shard to host memory (a device-to-host copy on a GPU) and waits for the
previous exchange before starting the next. After sending and receiving, the ranks agree on
the version in one small all-reduce: once it returns anywhere, every rank had received its
buddy's copy, so the version is committed and the older ones are dropped (keeper.py).

Why a gloo group: the copies live in host memory, and gloo moves host tensors directly (over
NCCL they would cross the device twice).
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import os
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from hybrid_ray.config.fault_tolerance import FaultToleranceConfig
from ..checkpoint.state import TrainState
from ..topology import Topology
from . import recover as rec
from . import snapshot as snap
from .keeper import KEEPER, Keeper

log = logging.getLogger("hybrid_ray")


class ReplicaError(RuntimeError):
    """A copy to or from the buddy failed (a peer lost mid-exchange, or a timeout)."""


class Replicator:
    """One engine's side of the ring. Collective to construct (it forms the gloo group)."""

    def __init__(self, topo: Topology, settings: FaultToleranceConfig, keeper: Keeper = KEEPER):
        self.topo, self.settings, self.keeper = topo, settings, keeper
        self.world, self.rank = topo.world_size, topo.rank
        timeout = datetime.timedelta(seconds=settings.timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.world > 1 else None
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="hybrid-ray-replicas")
        self._inflight: Optional[cf.Future] = None
        self._layout: Optional[tuple] = None  # (ids of the spaces, their layout)
        self.run: Optional[str] = None  # the checkpoint directory of the run (Engine sets it)
        self.pin = topo.device.type == "cuda"
        # How the last load went: {"source": "memory" | "disk", "step", "reason", "seconds"}.
        self.last_recovery: Optional[dict] = None
        # The recovered rank's other state (the engine's compression state), at the same size only.
        self.rank_state: Optional[dict] = None

    # ---- recovery and the run's checkpoints --------------------------------------------
    def recover(self, ts: TrainState, directory: str) -> Optional[int]:
        """The newest state the group's memories hold for the run saved in `directory`, loaded
        into `ts`: its step, or None (nothing loaded) when some rank's shard is held nowhere.
        Collective."""
        self.run = run_label(directory)
        self.keeper.settle(self.settings.timeout_s)  # the old group's exchange has ended first
        t0 = time.perf_counter()
        step, why, mine = rec.recover(ts, self.keeper, self.group, self.run)
        self.rank_state = mine.rank if mine is not None else None
        seconds = time.perf_counter() - t0
        self.last_recovery = {"source": "memory" if step is not None else "disk", "step": step,
                              "reason": why, "seconds": round(seconds, 3)}
        if step is not None:
            ts.log(f"recovered step {step} from the replicas in memory in {seconds:.2f} s (no disk read)")
        elif self.keeper.run == self.run:
            ts.log(f"replicas in memory not used: {why}; loading the newest checkpoint", logging.WARNING)
        return step

    def saw_checkpoint(self, directory: str, step: int) -> None:
        """The run saved or loaded a checkpoint at `step` (-1: none found): memory older than
        that is never preferred to it."""
        self.run = run_label(directory)
        self.keeper.saw_disk(self.run, step)

    # ---- the training thread -----------------------------------------------------------
    def after_step(self, ts: TrainState, step: int, rank_state: Callable[[], dict]) -> None:
        """Called after each optimizer step: snapshot and start the exchange every interval.
        rank_state: the engine's other per-rank state (its compression state)."""
        if step % self.settings.copy_interval:
            return
        self.wait()
        spaces = tuple(id(s) for s in ts.spaces)  # a precision switch lays the spaces out anew
        if self._layout is None or self._layout[0] != spaces:
            self._layout = (spaces, snap.layout(ts))
            self.keeper.start(self.run)
        reuse = self.keeper.recycled("own")
        tensors = snap.copy_into(snap.shard_tensors(ts), reuse.tensors if reuse else None, self.pin)
        own = snap.Snapshot(step, self.rank, self.world, tensors, snap.small_state(ts, self._layout[1], rank_state()), self.run)
        event = torch.cuda.Event() if self.pin else None
        if event is not None:
            event.record()
        self.keeper.put_own(own)
        self._inflight = self._pool.submit(self._exchange, own, event)
        self.keeper.inflight = self._inflight

    def wait(self) -> None:
        """Wait for the exchange in flight; its failure is raised here, once."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001 - one type for the caller, the cause chained
            raise ReplicaError(f"rank {self.rank}: copying the shard to its buddy failed: "
                               f"{type(e).__name__}: {str(e)[:300]}") from e

    def close(self, wait: bool) -> None:
        """Stop; with `wait` the exchange in flight completes first (a healthy group)."""
        if wait:
            try:
                self.wait()
            except ReplicaError as e:
                log.warning("%s", e)
        self._pool.shutdown(wait=False)

    # ---- the exchange thread -----------------------------------------------------------
    def _exchange(self, own: snap.Snapshot, event: Optional[torch.cuda.Event]) -> None:
        if event is not None:
            event.synchronize()
        if self.group is None:
            self.keeper.commit(own.step)
            return
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        reuse = self.keeper.recycled("held")
        flat = [t for ts in own.tensors for t in ts.values()]
        recv_tensors = snap.empty_like(own.tensors, False) if reuse is None else reuse.tensors
        incoming = [t for ts in recv_tensors for t in ts.values()]
        if [t.shape for t in incoming] != [t.shape for t in flat]:
            recv_tensors = snap.empty_like(own.tensors, False)
            incoming = [t for ts in recv_tensors for t in ts.values()]
        size_out = torch.tensor([len(own.small)], dtype=torch.int64)
        size_in = torch.empty(1, dtype=torch.int64)
        self._swap([size_out], [size_in], nxt, prev)
        small_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
        payload = torch.frombuffer(bytearray(own.small), dtype=torch.uint8)
        self._swap(flat + [payload], incoming + [small_in], nxt, prev)
        held = snap.Snapshot(own.step, prev, self.world, recv_tensors, small_in.numpy().tobytes(), own.run)
        self.keeper.put_held(held)
        version = torch.tensor([own.step], dtype=torch.int64)
        dist.all_reduce(version, op=dist.ReduceOp.MIN, group=self.group)
        self.keeper.commit(int(version.item()))

    def _swap(self, send: List[torch.Tensor], recv: List[torch.Tensor], nxt: int, prev: int) -> None:
        """Send `send` to the next rank and receive `recv` from the previous, all at once."""
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=prev, tag=i) for i, t in enumerate(recv)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def run_label(directory: str) -> str:
    """One name per run folder, however the caller spelled it."""
    d = str(directory).rstrip("/")
    return d if "://" in d else os.path.abspath(d)
