"""The worker actor: owns one GPU (or some CPUs), joins a process group, runs the training function.

The training runs on a thread of the actor, so the driver can poll the actor while it trains.
A group is formed with a fresh TCP rendezvous for every membership change; when the training
ends (finished, stopped, or failed because a peer vanished) the process group is destroyed and
the actor waits for the next one. The process itself lives on: the driver keeps healthy actors.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hybrid_ray.engine import Topology, gloo_on_loopback, warm_up
from hybrid_ray.engine.replicas import handoff

from .context import StopTraining, WorkerContext
from .records import Record, SystemSample
from .spare_copies import SparePusher
from .status import FAILED, FINISHED, IDLE, RUNNING, STOPPED


class Worker:
    """Body of the Ray actor (the Ray layer wraps it with ray.remote)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)  # records acknowledged (flush waits on it)
        self._state = IDLE
        self._error: Optional[str] = None
        # Records not yet acknowledged by the driver, with their sequence numbers: a poll whose
        # reply the driver never got (a timeout under load) must not lose them.
        self._records: List[Tuple[int, Record]] = []
        self._seq = 0
        self._step = -1
        self._step_time = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._result: Any = None
        self._directive: Optional[dict] = None  # the driver's newest (context.agree_on_directive)
        # The current group's Topology.abort: set at teardown, it ends the engine's commit waits.
        self._abort = threading.Event()
        self._next: Optional[Tuple[Callable, Dict[str, Any]]] = None  # prepare()'d, for launch()
        self._monitor: Any = None  # hybrid_ray.tracking.system.SystemMonitor of this node
        self._monitor_label: Optional[str] = None
        self._pusher = SparePusher()  # a lone worker's replica copies to the warm spares

    # ---- identity and rendezvous -----------------------------------------------------
    def info(self) -> Dict[str, Any]:
        import ray  # only ever called on the actor; the class itself is tested without Ray
        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        import ray
        with socket.socket() as s:  # on the node's own address: loopback for a local cluster
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def warm(self, fn: Callable[[WorkerContext], Any]) -> bool:
        """A spare's start: the training function arrives unpickled (its imports done here), a
        throwaway engine takes one step (first-use imports, the device's kernels), and the
        function's own `warm()`, where it has one, prepares what else it can ahead (its model:
        see context.warmed)."""
        warm_up(torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
        warm = getattr(fn, "warm", None)
        if callable(warm):
            warm()
        return True

    # ---- a training run ---------------------------------------------------------------
    def prepare(self, fn: Callable[[WorkerContext], Any], spec: Dict[str, Any]) -> None:
        """Take the training function and this worker's place in the next group; `launch`
        starts it. Two calls, so that every member has unpickled the function (which can import
        a lot in a fresh actor) before any of them enters the rendezvous, whose wait is bounded
        by the collective timeout."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("worker is still running the previous group's training")
        self._next = (fn, spec)

    def launch(self) -> None:
        """Join the prepared group and run its training function on a thread; returns at once."""
        fn, spec = self._next
        with self._lock:
            self._state, self._error, self._result = RUNNING, None, None
            self._step, self._step_time = -1, time.monotonic()
        self._stop.clear()
        self._directive = spec.get("directive")  # in force when this group formed
        self._abort = threading.Event()  # a new group: waits of the old one stay ended
        self._thread = threading.Thread(target=self._main, args=(fn, spec), daemon=True,
                                        name=f"hybrid-ray-train-g{spec['generation']}")
        self._thread.start()

    def start(self, fn: Callable[[WorkerContext], Any], spec: Dict[str, Any]) -> None:
        """prepare and launch in one call (a single worker, tests)."""
        self.prepare(fn, spec)
        self.launch()

    def _main(self, fn: Callable[[WorkerContext], Any], spec: Dict[str, Any]) -> None:
        state, error = FINISHED, None
        try:
            handoff.adopt_slots()  # a spare joining: the copy its lone worker left in shared slots
            topo = _join(spec, self._abort)
            ctx = WorkerContext(topo, spec["generation"], spec["storage_path"], spec["run_name"],
                                self._report, self._beat, self._stop.is_set, lambda: self._directive,
                                self._flush)
            self._result = fn(ctx)
        except StopTraining:
            state = STOPPED
        except BaseException:  # noqa: BLE001 - everything goes back to the driver
            state, error = FAILED, traceback.format_exc(limit=20)
        _leave(orderly=state != FAILED)
        with self._lock:
            self._state, self._error = state, error

    def _report(self, record: Record) -> None:
        with self._lock:
            self._seq += 1
            self._records.append((self._seq, record))

    def _flush(self, timeout_s: float) -> bool:
        """Wait until the driver has acknowledged every record reported so far (WorkerContext.
        flush_reports); False if some are still unacknowledged after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._acked:
            while self._records:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._acked.wait(left)
            return True

    def _beat(self, step: int) -> None:
        with self._lock:
            self._step, self._step_time = step, time.monotonic()

    # ---- what the driver calls while it runs -------------------------------------------
    def poll(self, ack: int = 0) -> Dict[str, Any]:
        """State, error, newest step and its age, and the metric records after `ack` as
        (sequence number, record) pairs. `ack`: the newest sequence number the driver has
        received; those up to it are dropped here, the rest are sent again until acknowledged."""
        with self._lock:
            self._drop_acked(ack)
            return {"state": self._state, "error": self._error, "step": self._step,
                    "step_age_s": time.monotonic() - self._step_time, "records": list(self._records)}

    def ack(self, seq: int) -> None:
        """The driver received every record up to `seq` (sent right after a poll's reply
        arrived, so a flush waits one round trip, not until the next poll)."""
        with self._lock:
            self._drop_acked(seq)

    def _drop_acked(self, ack: int) -> None:
        """Forget the records up to `ack` and wake a flush (the caller holds the lock)."""
        if self._records and self._records[0][0] <= ack:
            self._records = [(seq, rec) for seq, rec in self._records if seq > ack]
            self._acked.notify_all()

    # ---- a warm spare's copy of a lone worker ------------------------------------------
    def set_spares(self, handles: List[Any]) -> None:
        """The warm spares this worker, alone in its group, feeds its replica copies to
        (spare_copies.py); none: it stops."""
        self._pusher.set_spares(handles)

    def hold_copy(self, copy: Optional[dict]) -> int:
        """A spare keeps a lone worker's copy in its process: the spare that replaces the worker
        recovers from it without reading storage. The step it holds now (-1: none; None only
        asks)."""
        return handoff.import_copy(copy)

    def open_slots(self, spec: Dict[str, Any], node_id: str) -> Optional[str]:
        """A spare on the lone worker's node (`node_id`) shares memory for its copies
        (spare_copies.py); the slots' path, or None on another node."""
        import ray
        if node_id != ray.get_runtime_context().get_node_id():
            return None
        return handoff.open_slots(spec)

    def drop_slots(self) -> None:
        """This spare joins a group its lone worker is part of: it keeps no copy of it."""
        handoff.close_slots()

    def holds_slots(self) -> bool:
        """Whether this spare's lone worker copies into memory it shares (else it pushes)."""
        return handoff.holds_slots()

    def request_stop(self) -> None:
        """Stop at the next checkpoint boundary (growth)."""
        self._stop.set()

    def set_directive(self, directive: dict) -> None:
        """The driver's newest directive; the ranks agree on it at their next sync point."""
        self._directive = directive

    def abort(self) -> None:
        """The group is being torn down: stop, and end any checkpoint commit wait now (a peer
        whose files it waits for may be gone)."""
        self._stop.set()
        self._abort.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait for the training thread to end; False if it is still running (frozen)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def result(self) -> Any:
        return self._result

    def monitor_node(self, label: Optional[str], interval_s: float = 10.0) -> None:
        """Sample this node's system metrics (MLflow's collectors: CPU, memory, disk, network,
        GPUs through pynvml) under `system/<label>/` and send them as SystemSample records; None
        stops.
        The driver asks one worker per node, so a node is sampled once however many it hosts."""
        if label == self._monitor_label:
            return
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        self._monitor_label = label
        if label is not None:
            from hybrid_ray.tracking.system import SystemMonitor
            self._monitor = SystemMonitor(self._publish_system, interval_s, node_id=label)

    def _publish_system(self, values: Dict[str, float], index: int, ts: int) -> None:
        self._report(SystemSample(self._monitor_label, values, ts))


def _join(spec: Dict[str, Any], abort: threading.Event) -> Topology:
    """Form this generation's process group (fresh TCP rendezvous at the rank-0 worker)."""
    rank, world = spec["rank"], spec["world_size"]
    device = torch.device("cuda", 0) if spec["use_gpu"] else torch.device("cpu")
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    # Code that reads the environment (Topology.from_environment, torch helpers) sees this group.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=spec["master_addr"], MASTER_PORT=str(spec["master_port"]))
    if world == 1:
        return Topology(0, 1, device, None, abort)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The rendezvous waits for the slowest member to arrive (a fresh actor on a loaded node can
    # be seconds late), the collectives after it only for a peer that died or froze: two bounds.
    rendezvous_s = max(spec.get("rendezvous_timeout_s", 0), spec["collective_timeout_s"])
    _forget_failed_groups()
    gloo_on_loopback(spec["master_addr"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://{spec['master_addr']}:{spec['master_port']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=rendezvous_s))
    collective = datetime.timedelta(seconds=spec["collective_timeout_s"])
    if hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.distributed_c10d._set_pg_timeout(collective)
        return Topology(rank, world, device, dist.group.WORLD, abort)
    return Topology(rank, world, device, dist.new_group(timeout=collective), abort)


def _forget_failed_groups() -> None:
    """torch names a new group by a per-process counter that only a successful group's destroy
    resets; a rendezvous that failed (its rank 0 died while the group formed) leaves it one up,
    and the next group of this process would wait under another name than its fresh peers until
    the timeout. With no group alive, the count is zero."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def _leave(orderly: bool) -> None:
    """Destroy the group. After a clean end the ranks meet first: gloo tears a pair down badly
    when one side destroys while the other still sends. A group broken by a lost peer is
    dropped at once and for real: its connections close only when nothing holds the group any
    more (the failed engine sits in reference cycles until a collection), and their closing is
    what tells the ranks that were not connected to the lost one. Without it a rank waiting in
    a ring all-reduce on a peer that gave up waits for the collective timeout (30 s and more at
    4 workers, where only the lost rank's neighbours see its socket close)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not orderly:
        gc.collect()  # the failed engine's cycles: it holds the group and its Work handles
    try:
        if orderly:
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly; drop it anyway
        pass
    if not orderly:
        gc.collect()
