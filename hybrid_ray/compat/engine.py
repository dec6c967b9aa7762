"""The engine under DeepSpeed's names: the getters, boundaries and saves DeepSpeed scripts call.

`hybrid_ray.initialize` builds a `DeepSpeedEngine`: the Engine (hybrid_ray/engine/engine.py)
with this layer on top, so the engine itself keeps to training and knows nothing of DeepSpeed's
habits. What is added here:

- attributes: local_rank, global_rank, world_size, dp_world_size, mp_world_size;
- getters: fp16_enabled(), bfloat16_enabled(), zero_optimization_stage(), gradient_clipping(),
  get_data_parallel_group(), get_loss_scale(), get_mom();
- accumulation: set_gradient_accumulation_boundary(bool) and no_sync();
- saves: save_16bit_model / save_fp16_model, and save_checkpoint / load_checkpoint with
  DeepSpeed's argument order;
- the progress line DeepSpeed prints on rank 0 every `steps_per_print` optimizer steps.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

from ..config import NotSupportedError
from ..engine import Engine
from .zero_init import check_mics_shard_size

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class DeepSpeedEngine(Engine):
    """An Engine with DeepSpeed's remaining engine API (see the module docstring).

    print_steps: print DeepSpeed's progress line every steps_per_print steps on rank 0; a caller
    with its own progress output (the LM job) turns it off.
    """

    def __init__(self, *args: Any, print_steps: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_mics_shard_size(self.config.zero_optimization.mics_shard_size, self.topology.world_size)
        self.print_steps = print_steps
        self._manual_boundary: Optional[bool] = None
        self._in_no_sync = False

    # ---- who this process is ----------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.topology.rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        return self.topology.world_size  # the engine's topology is its data-parallel group

    @property
    def mp_world_size(self) -> int:
        stages = self.module.num_stages if self.is_pipe_parallel() else 1
        return stages * self.tp_world_size  # the ranks that hold one model replica

    def get_data_parallel_group(self) -> Any:
        """The data-parallel process group (None in a single process without a group)."""
        return self.topology.group

    # ---- settings ---------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    bf16_enabled = bfloat16_enabled

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_loss_scale(self) -> float:
        return self.loss_scale

    def get_mom(self) -> List[Any]:
        """Adam's betas or SGD's momentum, per parameter group (DeepSpeed's `mom`)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    # ---- accumulation boundaries ------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say yourself whether the next backward/step closes the accumulation window (set it
        before each forward/backward; the last one of a window True, then one engine.step()).
        The loss is still divided by the config's gradient_accumulation_steps."""
        self._manual_boundary = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._in_no_sync:
            return False
        if self._manual_boundary is not None:
            return self._manual_boundary
        return super().is_gradient_accumulation_boundary()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients on this rank without reducing them; the first
        backward after it reduces the sum of all of them (call engine.step() after that one).

        ZeRO stages 0 and 1 skip the reduction for real. At stages 2 and 3 each rank keeps only
        its shard of the gradients, so every backward must reduce (DeepSpeed refuses no_sync
        there): here it is a no-op with the same result, the communication is not saved."""
        if self._in_no_sync:
            raise RuntimeError("no_sync: already inside a no_sync context")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def step(self) -> None:
        if self._in_no_sync:
            raise RuntimeError("engine.step() inside no_sync(): leave the context, run the last "
                               "backward (which reduces the gradients), then step")
        if (not self.destroyed and not self._window_open and self.is_gradient_accumulation_boundary()
                and any(p.grad is not None for p in self.module.parameters())):
            # A direct loss.backward() fills the module's .grad and bypasses the engine: no loss
            # scaling, no reduction, nothing reaches the fp32 masters, so the step would change
            # nothing. Newer DeepSpeed supports it through autograd hooks; refuse it loudly.
            raise NotSupportedError(
                "engine.step() after a direct loss.backward(): not supported; the gradients never "
                "reached the engine (no loss scaling, no reduction, no update); call "
                "engine.backward(loss) instead")
        before = self.global_steps
        super().step()
        if self.global_steps != before:
            self._report_progress()

    def _report_progress(self) -> None:
        every = self.config.steps_per_print
        if not self.print_steps or self.topology.rank != 0 or self.global_steps % every:
            return
        print(f"[Rank 0] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
              f"mom={self.get_mom()}, loss_scale={self.loss_scale:g}", flush=True)

    # ---- saving -----------------------------------------------------------------------
    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's engine.compile(): torch.compile the module in place
        (`module.compile(backend=..., **compile_kwargs)`), once. DeepCompile's `schedule` and
        compiled autograd are not supported."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotSupportedError("engine.compile(schedule=, compiled_autograd_enabled=True): "
                                    "DeepCompile is not supported; call engine.compile() without them")
        if getattr(self, "_is_compiled", False):
            return
        from .accelerator import get_accelerator
        kwargs = dict(compile_kwargs or {})
        kwargs["backend"] = backend if backend is not None else get_accelerator().get_compile_backend()
        self.module.compile(**kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """torch.save the whole model's state_dict in the training dtype (fp16/bf16; fp32 when
        training in fp32) to save_dir/save_filename on rank 0. Works at every ZeRO stage
        (gathered from the fp32 masters, whatever stage3_gather_16bit_weights_on_model_save
        says). Collective: every rank calls it. Returns True."""
        state = self.consolidated_state_dict(_DTYPES[self.base_dtype], rank0_only=True)
        if self.topology.rank != 0:
            return True
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None) -> str:
        """Engine.save_checkpoint with DeepSpeed's arguments. `latest` is always written (the
        commit protocol relies on it) and frozen parameters are always saved."""
        if not save_latest:
            raise NotSupportedError("save_checkpoint: save_latest=False is not supported; "
                                    "`latest` is part of the commit (load a tag explicitly instead)")
        return super().save_checkpoint(save_dir, tag, client_state, async_save)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None):
        """Engine.load_checkpoint with DeepSpeed's argument order; the module is always loaded
        strictly (a checkpoint of another model is an error) and custom_load_fn is refused."""
        if custom_load_fn is not None:
            raise NotSupportedError("load_checkpoint: custom_load_fn is not supported")
        if not load_module_strict:
            raise NotSupportedError("load_checkpoint: load_module_strict=False is not supported; "
                                    "the checkpoint must hold every parameter of the model")
        return super().load_checkpoint(load_dir, None if tag is None else str(tag),
                                       load_optimizer_states=load_optimizer_states,
                                       load_lr_scheduler_states=load_lr_scheduler_states,
                                       load_module_only=load_module_only)
