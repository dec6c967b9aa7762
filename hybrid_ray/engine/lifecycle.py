"""The end of an engine's life: close(), destroy(), `with engine:` and interpreter exit.

A process group lives until its last reference goes, whatever `dist.destroy_process_group()`
says: that call drops only torch's own references, and gloo's worker threads, its TCP loop and
rank 0's TCPStore thread run until the C++ group is freed. An engine references the group
through its Topology (reducer, ZeRO optimizer, stage-3 units, checkpointer), and every Work
handle it keeps holds gloo's context too. So while an engine is alive it, not the script's
`destroy_process_group()`, decides when gloo is torn down: at module teardown for an engine
left in a script's globals, or never for one whose references leaked (the ZeRO-3 hooks did),
with gloo's threads still running while the process exits (issue 16: SIGABRT at exit,
"terminate called without an active exception").

`destroy()` is `close()` (collective only for a delayed offload update still to land) followed
by `release`: local, no collective. It waits for the collectives still in flight, stops the
background threads (checkpoint writer, offload update), and drops the parts that hold the
group; the engine keeps its module, optimizer, scheduler, counters and a Topology without the
group, and anything else it is asked for fails with an AttributeError that says so.

Every engine still alive at interpreter exit is released from an atexit hook, without
collectives (a peer may already be gone): atexit runs after threading's shutdown has joined
the background threads and before modules are torn down, while the interpreter is whole. A
script that ends with `dist.destroy_process_group()` and never calls destroy() then leaves no
engine reference to the group behind.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import weakref
from typing import Any, Optional

log = logging.getLogger("hybrid_ray")

# What an engine holds that references its process group; dropped by _release().
HOLDS_GROUP = ("reducer", "zero", "stage3", "checkpointer", "replicas")

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hooked = False
_own_default_group = False


def created_default_group() -> None:
    """hybrid_ray has just created torch's default process group (from the environment, or
    DeepSpeed's init_distributed): at interpreter exit, after the engines are released, it is
    destroyed too, unless the script did it. DeepSpeed scripts end without
    `destroy_process_group()`, and a group left to module teardown keeps gloo's threads (with
    work that holds tensors) running while the interpreter is torn down: SIGABRT at exit."""
    global _own_default_group
    _own_default_group = True
    _hook()


def _hook() -> None:
    global _hooked
    if not _hooked:
        atexit.register(release_all)
        _hooked = True


def track(engine: Any) -> None:
    """Release `engine` at interpreter exit if it is still alive then."""
    _live.add(engine)
    _hook()


def release_all() -> None:
    """Release every engine still alive (atexit): locally, its errors logged, not raised."""
    failed = False
    for engine in list(_live):
        try:
            engine._end(collective=False)
        except Exception as e:  # noqa: BLE001 - one engine's trouble must not stop the others
            log.warning("releasing an engine at exit: %s: %s", type(e).__name__, e)
            failed = True
    if failed:
        # The error's traceback holds the frames it passed (a checkpointer's, with its group),
        # in a cycle with the future that raised it: collect it while the interpreter is whole.
        gc.collect()
    if _own_default_group:
        _destroy_default_group()


def _destroy_default_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # local: no collective, a peer may be gone already
    except Exception as e:  # noqa: BLE001 - exit goes on whatever happens here
        log.warning("destroying the process group at exit: %s: %s", type(e).__name__, e)


class EngineLifecycle:
    """The Engine's close/destroy and context-manager methods (a mixin, like the accessors)."""

    def close(self) -> None:
        """Detach the engine from the model: remove its hooks, drop its buffers.

        The model keeps its current weights (as views of the engine's flat buffers). Call
        before `dist.destroy_process_group()` when an engine is rebuilt in a live process
        (elastic resizes, precision switches do this internally). Collective when a delayed
        parameter update is still in flight (it lands first): every rank calls it. A checkpoint
        save in flight is waited for first; its error is raised once the engine is closed. The
        engine still holds its process group: destroy() lets go of it as well.
        """
        if not self.__dict__.get("_destroyed"):
            self._close(collective=True)

    def destroy(self) -> None:
        """close(), then let go of everything the engine holds on its process group: the
        collectives still in flight are waited for, background threads stopped, Work handles
        and the parts that reference the group dropped. Collective as close() is. After it the
        module, optimizer, scheduler and counters stay readable; training calls fail. A second
        call does nothing. `with engine:` calls it when the block ends."""
        self._end(collective=True)

    @property
    def destroyed(self) -> bool:
        """destroy() has run: the engine's training calls fail."""
        return bool(self.__dict__.get("_destroyed"))

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        # After an exception the ranks may have parted: skip the collective part of close()
        # (a peer might never reach it), and let the block's own exception through.
        if exc_type is None:
            self._end(collective=True)
            return
        try:
            self._end(collective=False)
        except Exception as e:  # noqa: BLE001 - the block's exception is the one to see
            log.warning("destroying the engine after %s: %s: %s", exc_type.__name__,
                        type(e).__name__, e)

    def __getattr__(self, name: str) -> Any:
        # Reached only for a missing attribute: after destroy(), the parts that held the group
        # (directly, or from a property that reads one).
        if self.__dict__.get("_destroyed"):
            raise AttributeError(f"Engine.{name}: not available, this engine was destroyed "
                                 "(destroy() or the end of its `with` block); build a new engine "
                                 "to train again")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- internals ------------------------------------------------------------------------
    def _close(self, collective: bool) -> None:
        try:
            self.checkpointer.close()
        finally:
            self.flops_profiler.close()
            if collective:
                self.zero.close()  # a delayed update lands (all-gather), then its thread stops
            elif self.zero.offload is not None:
                self.zero.offload.close()  # the update in flight finishes; nothing is gathered
            self.checkpointing.remove()
            self._remove_hooks()
            self.reducer.grads.clear()
            if self.__dict__.get("replicas") is not None:
                self.replicas.close(wait=collective)  # the keeper keeps what was copied

    def _end(self, collective: bool) -> None:
        """close(), or its local part, then release the group (the work of destroy())."""
        if self.__dict__.get("_destroyed"):
            return
        try:
            self._close(collective)
        finally:
            self._release()

    def _release(self) -> None:
        """Wait for the engine's collectives in flight, then drop what references the group."""
        self.__dict__["_destroyed"] = True
        _live.discard(self)
        try:
            self.reducer.drain()
            if self.stage3 is not None:
                self.stage3.drain()
        except RuntimeError as e:  # a lost peer broke them: the group is being dropped anyway
            log.info("collectives in flight failed while releasing the engine: %s", str(e)[:200])
        finally:
            for name in HOLDS_GROUP:
                self.__dict__.pop(name, None)
            self.topology = dataclasses.replace(self.topology, group=None, model_group=None)

    def _drop_layout(self) -> None:
        """Remove the hooks and free the flat parameters, gradients, masters and optimizer state of the current
        layout once its values were exported: built next to a new layout they would double
        the device memory a precision switch needs. The objects stay (the old optimizer's
        groups still name the masters until they are rebound); their storage goes."""
        self._remove_hooks()
        for master in self.zero.masters:
            self.optimizer.state.pop(master, None)
            master.grad = None
            master.data = master.data.new_empty(0)
        for space in self.spaces:
            space.flat = space.flat.new_empty(0)
            space.local_shard = None
            for p in space.params:
                p.grad = None  # stages 0-1 (and one rank) keep .grad as views of the flat gradient
        self.reducer.grads.clear()

    def _remove_hooks(self) -> None:
        if self.zero.gather_overlap is not None:
            self.zero.gather_overlap.remove()
        self.precision_plan.remove()
        self.reducer.remove_hooks()
        if self.stage3 is not None:
            self.stage3.remove()
