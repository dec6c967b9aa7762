"""The Engine's state methods (a mixin, like the accessors): export, checkpoints, and the
in-memory replicas that a recovery tries before the checkpoints."""
from __future__ import annotations

from typing import Optional

import torch

from . import replicas
from .checkpoint import TrainState
from .parallelism import checkpoint_split, whole_state
from .zero import relayout


class EngineState:
    """consolidated_state_dict, save/wait/load_checkpoint and train_state."""

    def consolidated_state_dict(self, dtype: torch.dtype = torch.float32,
                                rank0_only: bool = True) -> dict:
        """The full model state on the CPU of rank 0 (every rank with rank0_only=False), from the
        fp32 masters, for export: works at every stage, gathering one flat space at a time, and
        with the model split (tensor parallelism, stages) under the unsplit model's names.
        All ranks must call it."""
        if self.zero.gather_overlap is not None:
            self.zero.gather_overlap.settle()  # the caller may read the live parameters next
        mesh, layout = self.topology.mesh, self._pipe_layout()
        split = mesh is not None or layout is not None
        state = relayout.consolidated_state_dict(self.module, self.spaces, self.zero.masters,
                                                 self.topology, dtype, rank0_only and not split)
        return whole_state(state, self._placed, mesh, layout, self.device, rank0_only) if split else state

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, async_save: Optional[bool] = None) -> str:
        """Write a checkpoint (local path or pyarrow.fs URI) loadable at any world size and
        ZeRO stage; see checkpoint/. Collective: every rank calls it. async_save (default:
        config `checkpoint.async_save`) returns once the state is copied to host memory; the
        files are written and committed in the background (see wait_checkpoint)."""
        path = self.checkpointer.save(save_dir, tag, client_state, async_save)
        if self.replicas is not None:
            self.replicas.saw_checkpoint(save_dir, self.global_steps)
        return path

    def wait_checkpoint(self) -> Optional[str]:
        """Block until this rank's asynchronous save is committed; its path (None if no save was
        in flight). Raises the save's CheckpointError, once. Not collective."""
        return self.checkpointer.wait()

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """(path, client_state) of the checkpoint loaded (tag None: `latest`, falling back to the
        newest good one), or (None, None). Collective: every rank calls it.

        With `fault_tolerance.replicas`, the newest state that the ranks' memories hold for the
        run saved in `load_dir` (their own shards and their buddies' copies, from before a lost
        worker) is tried first, when no tag is asked for: its path reads
        `memory:<load_dir>/global_step<N>` and nothing is read from storage."""
        whole = tag is None and load_optimizer_states and load_lr_scheduler_states and not load_module_only
        if self.replicas is not None:
            self.replicas.before_update()  # a snapshot's copy in flight reads the masters
        if self.replicas is not None and whole:
            # Memory older than the newest checkpoint is never preferred to it: a copy handed
            # to a spare before the last save does not know of that save.
            self.replicas.saw_checkpoint(load_dir, self.checkpointer.newest_step(load_dir))
            step = self.replicas.recover(self.train_state(), load_dir)
            if step is not None:
                if self.replicas.rank_state is not None:
                    self.reducer.load_compression_state(self.replicas.rank_state["compression"])
                self._window_open = False
                self._apply_schedule()
                return f"memory:{load_dir.rstrip('/')}/global_step{step}", {}
        out = self.checkpointer.load(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                     load_module_only)
        if out[0] is not None:
            self._window_open = False  # gradients of a window begun before the load are dropped
            self._apply_schedule()
        if self.replicas is not None:
            self.replicas.saw_checkpoint(load_dir, self.global_steps if out[0] is not None else -1,
                                         loaded=True)
        return out

    def train_state(self) -> TrainState:
        """What a checkpoint saves and restores, as of now (the layout changes with a precision
        switch, so it is built for each save and load)."""
        return TrainState(module=self.module, spaces=self.spaces, masters=self.zero.masters,
                          optimizer=self.optimizer, master_device=self.zero.master_device,
                          topology=self.topology, config=self.config, precision=self.base_dtype,
                          loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler,
                          counters=self.counters, data_loader=self.training_dataloader,
                          write_back=self.zero.write_back, log=self._log,
                          split=checkpoint_split(self.topology, self.module, self._placed),
                          compressor=self.reducer.compressor)


def build_replicas(engine) -> Optional["replicas.Replicator"]:
    """The engine's side of the buddy ring, when the config asks for replicas (collective)."""
    ft = engine.config.fault_tolerance
    return replicas.Replicator(engine.topology, ft) if ft.replicas else None
