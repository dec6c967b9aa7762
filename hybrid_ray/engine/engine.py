"""The Engine facade: forward, backward, step, with accumulation, clipping and loss scaling.

A training loop reads like DeepSpeed's:

    engine, optimizer, loader, scheduler = hybrid_ray.initialize(model, config=cfg)
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()          # acts only at the accumulation boundary

Elsewhere: precision.py decides dtypes per module; zero/ lays parameters out in flat buckets (flat.py),
moves gradients into fp32 master shards (reducer.py), steps the optimizer and gathers parameters back
(optimizer.py); loss_scaler.py scales fp16 losses; checkpoint/ saves and loads the TrainState; accessors.py
the DeepSpeed getters; lifecycle.py close/destroy/`with`; persistence.py export, checkpoints, replicas.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, List, Mapping, Optional, Union

import torch
import torch.nn as nn

from ..config import Config, load_config
from ..config.api import replace_section
from ..config.loader import to_plain
from . import build
from .accessors import DeepSpeedAccessors
from .activation_checkpointing import apply_activation_checkpointing
from .checkpoint import Checkpointer, StepCounters
from .compression import reduction_setup
from .loss_scaler import LossScaler, NoLossScaler, build_loss_scaler
from .zero.offload import HostOffload
from .precision import HALF, PrecisionPolicy, autocast_region, cast_floating, dtype_of
from .flops.profiler import StepProfiler
from .lifecycle import EngineLifecycle, track
from .persistence import EngineState, build_replicas
from .pipe import PipelineBatches
from .parallelism import checkpoint_topology, parallel_topology
from .zero.reducer import GradReducer, ReduceOptions
from .schedulers import build_scheduler
from .topology import Topology
from .zero import partial, partition as zero_partition, relayout, stage3
from .zero.optimizer import StepOutcome, ZeroOptimizer
from .zero.overlap import ParamGatherOverlap

log = logging.getLogger("hybrid_ray")


class NonFiniteGradientError(RuntimeError):
    """Too many consecutive steps had inf/NaN gradients in a run without dynamic loss scaling."""


class Engine(EngineLifecycle, EngineState, DeepSpeedAccessors, PipelineBatches):
    """Wraps a model for mixed-precision, ZeRO-sharded data-parallel training."""

    def __init__(self, model: nn.Module, config: Any, model_parameters: Any = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler: Any = None,
                 loss_scaler: Any = None, topology: Optional[Topology] = None,
                 tp_plan: Optional[Mapping[str, Any]] = None):
        self.config: Config = load_config(config)
        self.topology, placed = parallel_topology(model, topology or Topology.from_environment(),
                                                  self.config, tp_plan)
        self._placed = placed
        # Parameters whose values every tensor-parallel rank shares: counted once in the norm.
        self._norm_once = placed.replicated if placed and self.topology.mesh.tp_rank > 0 else set()
        self.batch = self.config.resolve_batch(self.topology.world_size)
        self.module = model.to(self.topology.device)
        self.counters = StepCounters()  # global_steps, micro_steps, ... (accessors.py)
        self._consecutive_skips = 0
        self._last: Optional[StepOutcome] = None
        self._window_open = False  # a backward since the last optimizer step
        self._window_t0: Optional[float] = None  # perf_counter at the window's first forward
        # Set by initialize(training_data=...) or by the caller: a loader (or its sampler) with
        # state_dict()/load_state_dict() has its data position saved in checkpoints.
        self.training_dataloader: Any = None
        self.checkpointer = Checkpointer(checkpoint_topology(self.topology, model), self.train_state,
                                         self.finish_delayed_update, self._log)
        self._groups = build.param_groups(model, model_parameters, optimizer,
                                          placed.renamed if placed else None)
        self._build_precision(self._scheduled_dtype(0))
        self.checkpointing = apply_activation_checkpointing(self.module, self.config.activation_checkpointing)
        self._build_zero(self._groups)
        self.optimizer = self._build_optimizer(self._groups, optimizer)
        self.lr_scheduler = lr_scheduler if lr_scheduler is not None else \
            build_scheduler(self.config.scheduler, self.optimizer)
        # fp16 anywhere in the run (base, a module, a schedule phase) needs the loss scaler; it
        # is consulted only while fp16 is part of the current precision mix.
        self.loss_scaler: LossScaler = build_loss_scaler(
            self.config.fp16, enabled=self._uses_fp16(), user_scaler=loss_scaler)
        self._unit_scaler = NoLossScaler()
        # Config `flops_profiler` (one report) and Speedometer requests (a silent profile).
        self.flops_profiler = StepProfiler(self.config.flops_profiler, self.module,
                                           self.topology.rank, self.topology.device.type)
        self._note_no_effect_settings()
        self.replicas = build_replicas(self)  # the buddy ring (fault_tolerance): collective
        track(self)  # released at interpreter exit if still alive (lifecycle.py)

    # ---- construction -----------------------------------------------------------------
    def _build_precision(self, base: str) -> None:
        pc = self.config.precision
        self.base_dtype = base
        self.compute_dtype = dtype_of(base)
        policy = PrecisionPolicy(self.compute_dtype, pc.modules, pc.norms_fp32, pc.norm_activations)
        self.precision_plan = policy.apply(self.module, self.topology.device.type)

    def _build_zero(self, groups: List[build.ParamGroup], broadcast: bool = True) -> None:
        zc, topo = self.config.zero_optimization, self.topology
        # Stage 3 with one rank has nothing to partition: it runs as stage 2.
        partition_params = zc.stage == 3 and topo.world_size > 1
        num_shards = topo.world_size if zc.stage >= 1 else 1
        # zero.Init shards: only stage 3's trained parameters stay partitioned, the rest are whole.
        zero_partition.unpartition_all(self.module, {id(p) for ps, _ in groups for p in ps}
                                       if partition_params else set())
        offload = HostOffload.from_config(zc.offload_optimizer, topo.device)  # None unless device: cpu
        ratio = partial.resolve_ratio(zc.offload_optimizer.ratio, topo.device,
                                      sum(p.numel() for ps, _ in groups for p in ps)) if offload else None
        if partition_params:
            self.spaces, unit_of_space, unit_mods = stage3.build_stage3_spaces(
                self.module, groups, topo.device, zc.reduce_bucket_size, topo,
                zc.stage3_param_persistence_threshold)
            if ratio is not None:
                partial.mark_units(self.spaces, ratio)
        else:
            self.spaces = build.build_spaces(groups, topo.device, zc.reduce_bucket_size, num_shards,
                                             topo.rank, ratio)
        if broadcast:
            build.broadcast_state(self.spaces, self.module, topo)
        if offload is not None and not any(s.offloaded for s in self.spaces):
            offload.close()  # "auto" kept everything on the device
            offload = None
        self.reducer = GradReducer(self.spaces, topo, ReduceOptions.from_config(zc, partition_params),
                                   reduction_setup(self.config), offload)
        self.zero = ZeroOptimizer(self.spaces, self.reducer, topo)
        self.zero.norm_excluded = set(self._norm_once)
        self.zero.step_scalars = lambda: (self._scaler.loss_scale, self.config.gradient_clipping)
        if zc.overlap_param_gather and zc.stage in (1, 2) and topo.world_size > 1:
            self.zero.gather_overlap = ParamGatherOverlap(self.module, self.spaces)
        self.stage3: Optional[stage3.Stage3Controller] = None
        if partition_params:  # after the masters are built from the whole parameters
            self.stage3 = stage3.build_controller(self.spaces, unit_of_space, unit_mods, topo,
                                                  zc.stage3_prefetch_bucket_size, self.zero)

    def _note_no_effect_settings(self) -> None:
        defaults = Config().flat_dict()
        ignored = build.no_effect_settings(self.config.flat_dict(), defaults)
        if ignored and self.topology.rank == 0:  # a warning: shown by default, once per message
            warnings.warn("accepted for DeepSpeed compatibility, no effect here: " + "; ".join(ignored),
                          stacklevel=3)

    def _master_groups(self) -> List[List[nn.Parameter]]:
        """Masters per optimizer group, with empty lists for groups with nothing to train."""
        masters = self.zero.master_groups()
        return masters + [[] for _ in range(len(self._groups) - len(masters))]

    def _build_optimizer(self, groups: List[build.ParamGroup],
                         client: Optional[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        masters = self._master_groups()
        if client is not None:
            opt = build.rebind_client_optimizer(client, masters)
        else:
            oc = self.config.optimizer
            opt = build.build_optimizer(oc.type, oc.params, masters, [h for _, h in groups],
                                        self.zero.master_device, host_step=self.zero.offload is not None)
        self.zero.attach_optimizer(opt)
        return opt

    def _fp16_in_model(self) -> bool:
        """An fp16 module in the current plan: the base, a pattern, or an FP16Layer/FP16Module."""
        return torch.float16 in self.precision_plan.module_dtype.values()

    def _uses_fp16(self) -> bool:
        """fp16 anywhere in the run: the base, a module pattern, a schedule phase, the model."""
        cfg = self.config
        return cfg.base_dtype == "fp16" or cfg.precision.uses_fp16 or self._fp16_in_model()

    @property
    def _scaler(self) -> LossScaler:
        """The fp16 loss scaler while fp16 is in the current precision mix, else a unit scale."""
        return self.loss_scaler if self._fp16_in_model() or not self._uses_fp16() else self._unit_scaler

    # ---- precision schedule -------------------------------------------------------------
    def _scheduled_dtype(self, step: int) -> str:
        """Base dtype for optimizer step `step`: the last schedule entry at or before it."""
        dtype = self.config.base_dtype
        for entry in self.config.precision.schedule:
            if entry.step <= step:
                dtype = entry.dtype
        return dtype

    def _apply_schedule(self) -> None:
        target = self._scheduled_dtype(self.global_steps)
        if target != self.base_dtype:
            self._log(f"step {self.global_steps}: precision {self.base_dtype} -> {target} (precision.schedule)")
            self._switch_precision(target)

    def _switch_precision(self, base: str) -> None:
        """Re-lay the parameters out for a new base dtype; fp32 masters and optimizer state carry over."""
        self.zero.close()  # a delayed update lands first; the new layout gets a new offload
        state = relayout.export_state(self.spaces, self.zero.masters, self.optimizer, self.topology)
        scalars = relayout.scalar_state(self.optimizer, self.zero.masters)
        for params, _ in self._groups:
            for p in params:
                p.data = state[id(p)]["master"].clone()  # fp32, off the old flat buffers
        self._drop_layout()
        self._build_precision(base)
        self._build_zero(self._groups, broadcast=False)
        build.rebind_client_optimizer(self.optimizer, self._master_groups())
        relayout.import_state(self.spaces, self.zero.masters, self.optimizer, state, scalars)
        self.zero.attach_optimizer(self.optimizer)

    # ---- the training loop --------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model under the base precision; floating outputs come back as fp32."""
        self._refuse_stages("forward")
        if self.config.fp16.auto_cast and self.compute_dtype == torch.float16:
            args, kwargs = cast_floating(args, torch.float16), cast_floating(kwargs, torch.float16)
        self.flops_profiler.before_forward(self.global_steps, args, kwargs)
        if self._window_t0 is None and torch.is_grad_enabled():
            self._window_t0 = time.perf_counter()
        if self.stage3 is not None:
            self.stage3.before_forward()
        with autocast_region(self.topology.device.type, self.compute_dtype):
            out = self._run_module(args, kwargs)
        if self.stage3 is not None:
            self.stage3.after_forward()
        if self.config.precision.fp32_outputs and self.compute_dtype in HALF:
            out = cast_floating(out, torch.float32)
        self.flops_profiler.after_forward()
        return out

    def _run_module(self, args: tuple, kwargs: dict) -> Any:
        if self.stage3 is None:
            return self.module(*args, **kwargs)
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as e:  # most likely an empty (released) parameter read out of turn
            if _from_the_group(e):  # a lost peer, not the model: no hint
                raise
            raise RuntimeError(f"{e} [ZeRO-3: between uses a block's parameters are empty tensors; "
                               "a parameter read outside its own module's forward must be declared "
                               "with hybrid_ray.register_external_parameter(module, param)]") from e

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Scale the loss (loss scale / accumulation steps), backprop, reduce gradients."""
        self._refuse_stages("backward")
        gas = self.batch.gradient_accumulation_steps
        self.flops_profiler.before_backward()
        if not self._window_open:  # the window's first backward (not counted: boundaries can be set)
            self.reducer.start_window()
        self._window_open = True
        if self._window_t0 is None:
            self._window_t0 = time.perf_counter()
        self.reducer.before_backward(self.is_gradient_accumulation_boundary())
        if self.stage3 is not None:
            self.stage3.before_backward()
        scaled = loss.float() * (self._scaler.loss_scale / gas)
        scaled.backward()
        self.reducer.after_backward()
        if self.stage3 is not None:
            self.stage3.after_backward()
        self.flops_profiler.after_backward()
        return loss

    def step(self) -> None:
        """Apply the optimizer at the accumulation boundary; a no-op on other micro-steps."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.batch.micro_batch_size * self.topology.world_size
        if not boundary:
            return
        self.reducer.finish_window()
        if self.replicas is not None and self.replicas.replay:
            self._replayed_step()
            return
        if self.replicas is not None:
            self.replicas.before_update()  # the last snapshot's copy has read the masters
        self._last = self.zero.step(self._scaler.loss_scale, self.config.gradient_clipping)
        self._close_step()
        self._apply_schedule()
        if self.replicas is not None:
            self.replicas.after_step(self.train_state(), self.global_steps, self._rank_state)

    def _close_step(self) -> None:
        self._after_step(self._last)
        self._window_open = False
        if self._window_t0 is not None:
            self.reducer.stats.record_step_time(time.perf_counter() - self._window_t0)
            self._window_t0 = None
        self.global_steps += 1

    def _replayed_step(self) -> None:
        """A step whose update the buddy replays (fault_tolerance.mode replay). The order keeps
        a committed step recoverable whenever a peer is lost: the bookkeeping first (so the
        rank's state after the step is known), then the exchange with the buddy and its commit,
        then the update and the capture of the live state, and only then a collective (the
        parameters' all-gather) that a lost peer can break."""
        self.replicas.start_gradients(self.reducer.master_grads(), self.topology.group)  # overlaps the decision
        self._last, update = self.zero.prepare(self._scaler.loss_scale, self.config.gradient_clipping)
        self._close_step()
        self.replicas.replay_step(update, self.global_steps, self._rank_state)
        self.zero.apply(update)
        self.replicas.after_step(self.train_state(), self.global_steps, self._rank_state)
        if update is not None:
            self.zero.write_back()
        before = self.spaces
        self._apply_schedule()
        if self.spaces is not before:  # a precision switch laid the shards out anew
            self.replicas.after_step(self.train_state(), self.global_steps, self._rank_state)

    def _rank_state(self) -> dict:
        """This rank's own state besides the shard, for the buddy: the compression residuals."""
        return {"compression": self.reducer.compression_state()}

    def _after_step(self, outcome: StepOutcome) -> None:
        scaler = self._scaler
        old_scale = scaler.loss_scale
        scaler.update(outcome.overflow)
        self.reducer.end_step(outcome.overflow, scaler.loss_scale / old_scale)
        if not outcome.overflow:
            self._consecutive_skips = 0
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            return
        self.skipped_steps += 1
        self._consecutive_skips += 1
        if scaler.dynamic:
            self._log(f"step {self.global_steps}: gradient overflow, step skipped; "
                      f"loss scale {old_scale:g} -> {scaler.loss_scale:g}")
            return
        limit = self.config.precision.max_consecutive_skipped_steps
        self._log(f"step {self.global_steps}: non-finite gradient norm ({outcome.grad_norm}), step "
                  f"skipped ({self._consecutive_skips} in a row, limit {limit})", logging.WARNING)
        if self._consecutive_skips >= limit:
            raise NonFiniteGradientError(
                f"{limit} consecutive steps had inf/NaN gradients (precision {self.config.base_dtype}); "
                "the loss or the data has diverged: lower the learning rate, set gradient_clipping, "
                "check the inputs, or raise precision.max_consecutive_skipped_steps")

    def _log(self, msg: str, level: int = logging.INFO) -> None:
        if self.topology.rank == 0:
            log.log(level, msg)

    def zero_grad(self) -> None:
        """Clear accumulated gradients (the engine also does this at each window's start)."""
        self.reducer.start_window()

    def finish_delayed_update(self) -> None:
        """With `offload_optimizer.delayed_param_update`, land the update still running on the
        host, so the parameters are those of the last step; with `overlap_param_gather`, wait
        for the parameter all-gathers in flight. Call before reading the weights outside a
        forward or an engine method. A no-op otherwise. Collective: every rank calls it."""
        self.zero.flush()

    def compression_stats(self) -> dict:
        """Gradient bytes this rank sent in the last optimizer step against the uncompressed
        reduction, and how that step's time split: {"bytes_sent", "dense_bytes", "ratio",
        "total_bytes_sent", "total_dense_bytes", "steps", "step_s", "comm_wait_s", "compress_s",
        "warming"} (bytes zero with one rank). step_s: the window's wall time to the end of its
        step; comm_wait_s: exposed communication; compress_s: compression time; warming: in a
        compressor's warm-up (compression.CommStats)."""
        return self.reducer.stats.summary()

    @property
    def gradient_compression(self) -> dict:
        """The current `gradient_compression` setting, as a dict like the config section."""
        return to_plain(self.config.gradient_compression)

    def set_gradient_compression(self, spec: Union[None, str, Mapping[str, Any]]) -> None:
        """Switch gradient compression between optimizer steps: `spec` is a dict like the config
        section (it replaces the whole section), a type name, or None/"none" for dense.

        Validated as the config is (ConfigError naming `gradient_compression.<key>`). Not a
        collective, but every rank must call it at the same step. Error-feedback residuals of
        the old method are added into the next reduction of their bucket, so nothing is lost.
        """
        if self._window_open or self.micro_steps % self.batch.gradient_accumulation_steps:
            raise RuntimeError("set_gradient_compression: called inside a gradient accumulation "
                               "window; call it between optimizer steps (after engine.step() at "
                               "the accumulation boundary, before the next backward)")
        raw = {"type": "none"} if spec is None else {"type": spec} if isinstance(spec, str) else spec
        old, config = self.gradient_compression, replace_section(self.config, "gradient_compression", raw)
        self.zero.set_compression(reduction_setup(config))  # a refusal changes nothing
        self.config = config
        self._log(f"step {self.global_steps}: gradient_compression {old} -> {self.gradient_compression}")


def _from_the_group(e: BaseException) -> bool:
    """A collective failed (gloo or NCCL: a lost or frozen peer), as opposed to the model."""
    text = str(e)
    return isinstance(e, torch.distributed.DistError) or any(
        mark in text for mark in ("gloo", "NCCL", "ProcessGroup", "Connection reset", "Timed out"))
