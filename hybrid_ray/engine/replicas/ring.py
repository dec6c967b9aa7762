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

Replay mode (replay.py) sends the whole shard only as a base, and then each step's reduced
gradient before the update, on the training thread: the update waits for the buddy to have it
and for every rank to agree (the commit), so that whatever a lost peer breaks afterwards, every
shard can be brought to the same step. The buddy applies the step to its copy in the background.
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import os
import threading
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from hybrid_ray.config.fault_tolerance import FaultToleranceConfig
from ..checkpoint.state import TrainState
from ..topology import Topology
from . import recover as rec
from . import replay
from . import snapshot as snap
from .keeper import KEEPER, NOTHING_HELD, Keeper

log = logging.getLogger("hybrid_ray")


class ReplicaError(RuntimeError):
    """A copy to or from the buddy failed (a peer lost mid-exchange, or a timeout)."""


class Replicator:
    """One engine's side of the ring. Collective to construct (it forms the gloo group)."""

    def __init__(self, topo: Topology, settings: FaultToleranceConfig, keeper: Keeper = KEEPER):
        # Not the Topology: an exchange blocked on a lost peer must not hold the training
        # group, whose release is what tells the other ranks (cluster/worker.py _leave).
        self.settings, self.keeper = settings, keeper
        self.replay = settings.mode == "replay"
        # replay_on device: the copy lies where the owner's masters lie and steps with the
        # owner's kernel; device gradients travel over the training group (replay.py)
        self.on_device = self.replay and settings.replay_on == "device"
        self._based = False  # replay: the buddy holds this rank's shard in the current layout
        self._grads_in_flight: Optional[tuple] = None  # replay: (works, receive buffers) of this step
        self._rank_cache: Optional[tuple] = None  # replay: (step, the rank state sent with it)
        self.world, self.rank = topo.world_size, topo.rank
        self.token = keeper.begin()
        timeout = datetime.timedelta(seconds=settings.timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.world > 1 else None
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="hybrid-ray-replicas")
        self._inflight: Optional[cf.Future] = None
        self._copied: Any = None  # the last snapshot's copy: done before the next update
        self._stream: Any = None  # the side stream of device-to-host copies (GPU)
        self._layout: Optional[tuple] = None  # (ids of the spaces, their layout)
        self._lone_copying = False  # replay mode, copying as a lone rank for its spares
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
        t0 = time.perf_counter()
        step, why, mine = rec.recover(ts, self.keeper, self.group, self.run)
        self.rank_state = mine.rank if mine is not None else None
        seconds = time.perf_counter() - t0
        self.last_recovery = {"source": "memory" if step is not None else "disk", "step": step,
                              "reason": why, "seconds": round(seconds, 3)}
        if step is not None:
            self.keeper.rewind(step)
            self._layout = None  # the live state jumped: the buddy needs a new base
            ts.log(f"recovered step {step} from the replicas in memory in {seconds:.2f} s (no disk read)")
        elif self.keeper.run == self.run and why != NOTHING_HELD:
            ts.log(f"replicas in memory not used: {why}; loading the newest checkpoint", logging.WARNING)
        return step

    def saw_checkpoint(self, directory: str, step: int, loaded: bool = False) -> None:
        """The run saved or loaded (`loaded`) a checkpoint at `step` (-1: none found): memory
        older than that is never preferred to it, and a load gives up anything newer."""
        self.run = run_label(directory)
        self.keeper.saw_disk(self.run, step)
        if loaded and step >= 0:
            self.keeper.rewind(step)
        if loaded and self.replay:
            self.keeper.set_live(None, self.token)  # the live tensors were overwritten in place
            self._layout = None

    # ---- the training thread -----------------------------------------------------------
    def after_step(self, ts: TrainState, step: int, rank_state: Callable[[], dict]) -> None:
        """Called after each optimizer step: every copy_interval steps, copy the shard to host
        memory off the training thread's path (a side stream on a GPU, the exchange thread on
        the CPU) and send it to the buddy. rank_state: the engine's other per-rank state. A lone
        rank whose warm spare shares slots with it (slots.py) copies into those instead; in
        replay mode a lone rank (nobody to replay to) copies every step while spares want it."""
        writer = self.keeper.slot_writer if self.group is None else None
        if self.replay and not self._lone_copies():
            if self._lone_copying:  # back from copies to replay: it starts over from a base
                self._lone_copying, self._layout = False, None
            self._capture_live(ts, step, rank_state)
            return
        if not self.replay and step % self.settings.copy_interval:
            return
        self.wait()
        spaces = tuple(id(s) for s in ts.spaces)  # a precision switch lays the spaces out anew
        if self._layout is None or self._layout[0] != spaces:
            self._layout = (spaces, snap.layout(ts))
            self.keeper.start(self.run)
        live = snap.shard_tensors(ts)
        begun = writer.begin(live) if writer is not None else None
        slot = (writer, *begun) if begun is not None else None
        self._lone_copying = self.replay
        into = slot[2] if slot is not None else getattr(self.keeper.recycled("own"), "tensors", None)
        small = snap.small_state(ts, self._layout[1], rank_state())  # counters, RNG: this thread's
        copied: Any = threading.Event()
        if self.pin:
            live, copied = self._device_copy(live, into), torch.cuda.Event()
            copied.record(self._stream)
            into = None
        self._copied = copied
        own = snap.Snapshot(step, self.rank, self.world, [], small, self.run)
        self._inflight = self._pool.submit(self._copy_and_exchange, own, live, into, copied, slot)

    # ---- replay mode ------------------------------------------------------------------------
    def _lone_copies(self) -> bool:
        """A lone rank whose warm spares take its copies (into their slots, or pushed)."""
        return self.group is None and (self.keeper.slot_writer is not None or self.keeper.copies_wanted)

    def _capture_live(self, ts: TrainState, step: int, rank_state: Callable[[], dict]) -> None:
        """The rank's state after `step`, by reference; a base for the buddy when it has none
        in this layout (the ring's first step, a precision switch, a load)."""
        spaces = tuple(id(s) for s in ts.spaces)
        rebase = self._layout is None or self._layout[0] != spaces
        if rebase:
            self.wait()
            self._layout = (spaces, snap.layout(ts))
            self.keeper.start(self.run)
            self._based = False
        spec = replay.optimizer_spec(ts) if rebase else None
        cached, self._rank_cache = self._rank_cache, None  # what replay_step sent (copied once)
        mine = cached[1] if cached is not None and cached[0] == step else rank_state()
        small = snap.small_state(ts, self._layout[1], mine, spec)
        live = snap.Snapshot(step, self.rank, self.world, snap.shard_tensors(ts), small, self.run, live=True)
        self.keeper.set_live(live, self.token)
        if rebase:
            host = [{k: t.to("cpu", copy=True) for k, t in ts_.items()} for ts_ in live.tensors]
            base = snap.Snapshot(step, self.rank, self.world, host, small, self.run)
            # the buddy's layout is this rank's: its space i lies where this rank's does
            devices = [m.device for m in ts.masters] if self.on_device else None
            self._inflight = self._pool.submit(self._send_base, base, devices)

    def _send_base(self, base: snap.Snapshot, devices: Optional[List[torch.device]] = None) -> None:
        if self.group is None:
            self.keeper.commit(base.step, self.token)
            self._based = True
            return
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        recv = snap.empty_like(base.tensors, False)
        small_in = self._swap_bytes(base.small, nxt, prev, [t for ts in base.tensors for t in ts.values()],
                                    [t for ts in recv for t in ts.values()])
        if devices is not None:
            recv = [{k: t.to(d) for k, t in ts_.items()} for ts_, d in zip(recv, devices)]
        held = snap.Snapshot(base.step, prev, self.world, recv, small_in, base.run)
        held.stepper = replay.Stepper(snap.parse_small(small_in).stepper, recv, owners_kernel=devices is not None)
        self.keeper.put_held(held, self.token)
        self._commit(base.step)
        self._based = True

    def start_gradients(self, grads: List[torch.Tensor], training: Optional[dist.ProcessGroup] = None) -> None:
        """At the window's end, before the step's decision: start sending this rank's reduced
        gradient shards to the buddy and receiving its predecessor's, so that the transfer
        overlaps the global norm and the bookkeeping. replay_step finishes it. `training`: the
        training group, which carries the shards that stay on the device (replay_on device)."""
        self._grads_in_flight = None
        if not self.replay or self.group is None:
            return
        self.wait()  # the base, or the last step's application to the copy
        if not self._based:
            return
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        carriers = [self._carrier(g, training) for g in grads]
        out = [g.detach() if c is not self.group else g.detach().to("cpu") for g, c in zip(grads, carriers)]
        got = [torch.empty_like(g) for g in out]
        works = []
        for carrier in {id(c): c for c in carriers}.values():  # one batch per group
            mine = [i for i, c in enumerate(carriers) if c is carrier]
            ops = [dist.P2POp(dist.isend, out[i], group=carrier, group_peer=nxt, tag=_GRAD_TAG + i) for i in mine]
            ops += [dist.P2POp(dist.irecv, got[i], group=carrier, group_peer=prev, tag=_GRAD_TAG + i)
                    for i in mine]
            works += dist.batch_isend_irecv(ops)
        self._grads_in_flight = (works, got)

    def _carrier(self, t: torch.Tensor, training: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
        """The group a gradient shard travels over: the training group when the copy is kept on
        the device and that group's backend moves tensors of this device (NCCL for a GPU's, gloo
        for the CPU's; "cpu:gloo,cuda:nccl" both), else the ring's gloo group via host memory."""
        if not self.on_device or training is None:
            return self.group
        backend = str(dist.get_backend(training)).lower()
        return training if ("nccl" if t.is_cuda else "gloo") in backend else self.group

    def replay_step(self, update: Any, step: int, rank_state: Callable[[], dict]) -> None:
        """Before the update of `step`: the reduced gradient shard (None: an overflow skipped the
        step) and this rank's own state go to the buddy, the buddy's come here, and every rank
        agrees before any applies. Raises ReplicaError when a peer is lost on the way."""
        self.wait()  # the base, or the last step's application to the copy
        if not self._based or self._lone_copies():
            return  # no base yet (not a version the buddy can rebuild), or copies, not replay
        if self.group is None:  # one rank: nothing to send, the step is committed as it is
            self.keeper.commit(step, self.token)
            self.keeper.set_live(None, self.token)
            return
        mine = rank_state()
        self._rank_cache = (step, mine)
        part = snap.pack({"rng": snap.rng_objects(), "rank": mine})
        hyper = replay.hyperparameters(update.optimizer) if update is not None else None
        data = replay.header(step, update.coef if update is not None else 0.0, hyper, part,
                             update.frozen if update is not None else None)
        try:
            self._replay_exchange(step, data, update is not None)
        except Exception as e:  # noqa: BLE001 - one type for the caller, the cause chained
            raise ReplicaError(f"rank {self.rank}: sending step {step}'s gradient to its buddy failed: "
                               f"{type(e).__name__}: {str(e)[:300]}") from e
        self.keeper.set_live(None, self.token)  # committed: the update now writes into it

    def _replay_exchange(self, step: int, data: bytes, applied: bool) -> None:
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        header_in = self._swap_bytes(data, nxt, prev)
        flight, self._grads_in_flight = self._grads_in_flight, None
        if flight is None:
            raise RuntimeError("replay: the step's gradients were never sent (start_gradients)")
        for work in flight[0]:
            work.wait()
        # An overflow is agreed by every rank: the gradients went anyway, and are not applied.
        pending = replay.pending_from(header_in, flight[1] if applied else None)
        pending.mark_arrived()  # after the waits: on a GPU the receives are ordered before it
        self.keeper.set_pending(pending, self.token)
        self._commit(step)
        self._inflight = self._pool.submit(self.keeper.advance)

    def _swap_bytes(self, data: bytes, nxt: int, prev: int, send: List[torch.Tensor] = (),
                    recv: List[torch.Tensor] = ()) -> bytes:
        """Send `data` (and the tensors `send`) to the next rank and receive the previous rank's
        bytes (and `recv`): the sizes first, then everything in one exchange."""
        size_out, size_in = torch.tensor([len(data)], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        self._swap([size_out], [size_in], nxt, prev)
        got = torch.empty(int(size_in.item()), dtype=torch.uint8)
        self._swap(list(send) + [torch.frombuffer(bytearray(data), dtype=torch.uint8)], list(recv) + [got],
                   nxt, prev)
        return got.numpy().tobytes()

    def _commit(self, step: int) -> None:
        version = torch.tensor([step], dtype=torch.int64)
        dist.all_reduce(version, op=dist.ReduceOp.MIN, group=self.group)
        self.keeper.commit(int(version.item()), self.token)

    def before_update(self) -> None:
        """Called before the optimizer writes into the masters: the copy of the last snapshot
        must have read them by then (it overlapped the forward and backward since)."""
        copied, self._copied = self._copied, None
        if copied is None:
            return
        if isinstance(copied, threading.Event):
            while not copied.wait(0.05):
                if self._inflight is None or self._inflight.done():
                    break  # the exchange failed before copying: wait() raises it
        else:
            torch.cuda.current_stream().wait_event(copied)

    def _device_copy(self, live: List[snap.Tensors], into: Optional[List[snap.Tensors]]) -> List[snap.Tensors]:
        """Device-to-host copies into pinned buffers on a side stream, after the step's kernels."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            return snap.copy_into(live, into, True)

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
        self._grads_in_flight = None  # receive buffers of a step that will not be applied
        self._pool.shutdown(wait=False)

    # ---- the exchange thread -----------------------------------------------------------
    def _copy_and_exchange(self, own: snap.Snapshot, live: List[snap.Tensors],
                           into: Optional[List[snap.Tensors]], copied: Any, slot: Optional[tuple]) -> None:
        try:
            if isinstance(copied, threading.Event):  # host tensors: copied here, then released
                own.tensors = snap.copy_into(live, into, False)
                copied.set()
            else:
                copied.synchronize()
                own.tensors = live  # the pinned copies the side stream filled
            if slot is not None:  # into the spare's slots: it holds the step now
                slot[0].finish(slot[1], own, self.keeper.disk_step)
                return
        finally:
            if slot is not None:
                slot[0].end()
        self.keeper.put_own(own, self.token)
        if self.group is None:
            self.keeper.commit(own.step, self.token)
            return
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        reuse = self.keeper.recycled("held")
        flat = [t for ts in own.tensors for t in ts.values()]
        recv_tensors = snap.empty_like(own.tensors, False) if reuse is None else reuse.tensors
        incoming = [t for ts in recv_tensors for t in ts.values()]
        if [t.shape for t in incoming] != [t.shape for t in flat]:
            recv_tensors = snap.empty_like(own.tensors, False)
            incoming = [t for ts in recv_tensors for t in ts.values()]
        small_in = self._swap_bytes(own.small, nxt, prev, flat, incoming)
        self.keeper.put_held(snap.Snapshot(own.step, prev, self.world, recv_tensors, small_in, own.run), self.token)
        self._commit(own.step)

    def _swap(self, send: List[torch.Tensor], recv: List[torch.Tensor], nxt: int, prev: int) -> None:
        """Send `send` to the next rank and receive `recv` from the previous, all at once."""
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=prev, tag=i) for i, t in enumerate(recv)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


_GRAD_TAG = 1000  # gradient transfers stay in flight beside the header's: tags apart


def run_label(directory: str) -> str:
    """One name per run folder, however the caller spelled it."""
    d = str(directory).rstrip("/")
    return d if "://" in d else os.path.abspath(d)
