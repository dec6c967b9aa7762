"""Config sections other than optimizer/scheduler: precision, ZeRO, compression, profiling.

Key names and defaults follow DeepSpeed so its JSON configs load unchanged; `precision` is ours.
Every field carries its rules in `checked(...)` metadata; cross-field rules live in `validate`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from hybrid_ray.config.errors import NotSupportedError, Verbatim, config_error, join_path
from hybrid_ray.config.hardware import native_bf16
from hybrid_ray.config.loader import checked, load_value

Dtype = Literal["fp32", "fp16", "bf16"]
BF16Enabled = Literal[True, False, "auto"]


def check_regex(pattern: str, path: str) -> None:
    """Compile a user regex now, so a typo fails at load time rather than mid-model-wrap."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise config_error(path, "invalid regular expression", pattern,
                           f"a Python regex ({exc})") from None


@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision: fp16 params/compute, fp32 master weights, loss scaling."""

    enabled: bool = False
    """Train in fp16 (mutually exclusive with bf16.enabled)."""
    loss_scale: float = checked(0.0, ge=0)
    """0 means dynamic loss scaling; > 0 is a fixed (static) scale."""
    initial_scale_power: int = checked(16, ge=0, le=64)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = checked(1000, ge=1)
    """Overflow-free steps before the dynamic scale is doubled."""
    hysteresis: int = checked(2, ge=1)
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step, not only on scale increases."""
    min_loss_scale: float = checked(1.0, gt=0)
    """Floor of the dynamic loss scale."""
    auto_cast: bool = False
    """Cast floating inputs of forward to fp16 (DeepSpeed's fp16.auto_cast)."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (not supported: masters are fp32)."""

    def validate(self, path: str) -> None:
        """A dynamic scale starts at 2**initial_scale_power and never goes below min_loss_scale:
        a floor above the start is a contradiction. Checked while fp16 is off too, since fp16
        modules (precision.modules, FP16Layer) use this section's scaler."""
        start = 2.0 ** self.initial_scale_power
        if self.loss_scale == 0 and self.min_loss_scale > start:
            raise config_error(f"{path}.min_loss_scale", "out of range", self.min_loss_scale,
                               f"allowed: <= 2**initial_scale_power = {start:g} (the dynamic "
                               f"scale starts there)")


@dataclass(frozen=True)
class BF16Config:
    """bf16 mixed precision: bf16 params/compute, fp32 master weights, no loss scaling."""

    enabled: BF16Enabled = checked(False, convert=lambda raw, path, _: _bf16_enabled(raw, path))
    """Train in bf16 (mutually exclusive with fp16.enabled). "auto": where this machine computes
    bf16 natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32."""
    immediate_grad_update: bool = False
    """DeepSpeed: add each micro-batch's bf16 gradients into fp32 right after its backward.
    No effect here: gradients reach fp32 at the engine's reduction (every micro-batch at ZeRO
    2/3; at the accumulation boundary at ZeRO 0/1, after accumulating in bf16)."""


@dataclass(frozen=True)
class OffloadConfig:
    """Where optimizer state or parameters live between uses."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """'none' keeps them on the accelerator."""
    pin_memory: bool = False
    """Use pinned host memory for faster, asynchronous copies."""
    buffer_count: int = checked(4, ge=1)
    """Number of staging buffers for offloaded tensors."""
    fast_init: bool = False
    """Initialise offloaded optimizer state in bulk (nvme)."""
    delayed_param_update: bool = False
    """Overlap the CPU optimizer step with the next forward (updates land one step late)."""
    overlap_step: bool = False
    """Step the host share bucket by bucket while backward runs, as each gradient bucket lands
    (torch's Adam or AdamW; the update is the one without it). With gradient_clipping the step
    still waits for the norm unless clip_with_previous_norm."""
    clip_with_previous_norm: bool = False
    """With overlap_step and gradient_clipping: clip by the previous step's global norm, so
    that the step need not wait for this one's (an approximation; off: the exact clip)."""
    ratio: object = checked(1.0, convert=lambda raw, path, _: _offload_ratio(raw, path))
    """Partial offload (DeepSpeed's ZeRO-Offload++ Twin-Flow), at every stage: the fraction of
    the parameters whose fp32 masters, gradients and optimizer state live on the host and step
    on the CPU; the rest stay and step on the device. 1.0 (DeepSpeed's default) offloads all;
    "auto" keeps on the device what fits in half of the device memory left free once the model
    is built (engine/zero/partial.py)."""


def _bf16_enabled(raw: object, path: str) -> bool:
    value = load_value(BF16Enabled, raw, path)
    return native_bf16() if value == "auto" else value


def _offload_ratio(raw: object, path: str) -> object:
    if raw == "auto":
        return "auto"
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise config_error(path, "expected a number or \"auto\"", raw, "a fraction in (0, 1], or \"auto\"")
    if not 0 < raw <= 1:
        raise config_error(path, "out of range", raw, "a fraction in (0, 1], or \"auto\"")
    return float(raw)


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO sharding: 0 off, 1 optimizer state, 2 + gradients, 3 + parameters."""

    stage: int = checked(0, choices=(0, 1, 2, 3))
    """ZeRO stage."""
    allgather_partitions: bool = True
    """Rebuild updated parameters with one all-gather (else a series of broadcasts)."""
    allgather_bucket_size: int = checked(500_000_000, ge=1)
    """Elements all-gathered at a time."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter (else all-reduce). gloo (CPU) groups all-reduce
    either way: gloo's reduce-scatter takes about twice as long as its all-reduce."""
    reduce_bucket_size: int = checked(50_000_000, ge=1)
    """Elements reduced at a time."""
    overlap_param_gather: bool = False
    """Stages 1-2: leave the all-gather of updated parameters in flight when the step returns
    and wait for each bucket just before the forward of the first module that uses it.
    Parameters read outside a module's forward, state_dict() or an engine method need
    `engine.finish_delayed_update()` first (see engine/zero/overlap.py)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    offload_optimizer: OffloadConfig = checked(default_factory=OffloadConfig, null_is_default=True)
    """Optimizer-state offload (stage >= 1); null means the default (no offload)."""
    offload_param: OffloadConfig = checked(default_factory=OffloadConfig, null_is_default=True)
    """Parameter offload (stage 3); null means the default (no offload)."""
    stage3_prefetch_bucket_size: int = checked(50_000_000, ge=0)
    """Stage 3: elements of upcoming parameters to prefetch."""
    stage3_param_persistence_threshold: int = checked(100_000, ge=0)
    """Stage 3: parameters smaller than this stay gathered."""
    stage3_max_live_parameters: int = checked(1_000_000_000, ge=0)
    """Stage 3: cap on gathered parameter elements per GPU."""
    stage3_max_reuse_distance: int = checked(1_000_000_000, ge=0)
    """Stage 3: keep a parameter gathered if it is reused within this many elements."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather full 16-bit weights when saving the model."""
    sub_group_size: int = checked(1_000_000_000, ge=1)
    """Elements per optimizer-step sub-group (bounds temporary memory)."""
    round_robin_gradients: bool = False
    """Stage 1/2: spread gradient copies across ranks round-robin."""
    mics_shard_size: int = checked(-1, ge=-1)
    """MiCS: shard parameters over groups of this many ranks, replicated across groups; -1 off.
    Only the whole data-parallel world is supported (the same partitioning as ZeRO-3); another
    size is refused when the engine starts (hybrid_ray/compat/zero_init.py)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS: gather parameters node by node. No effect here (one flat all-gather)."""
    stage3_model_persistence_threshold: Optional[int] = checked(None, ge=0)
    """Stage 3: cap on the elements kept gathered as persistent small parameters (None: no cap).
    No effect here: stage3_param_persistence_threshold alone decides."""
    zero_hpz_partition_size: int = checked(1, ge=1)
    """ZeRO++ hierarchical partitioning: ranks holding a secondary parameter copy; must be 1
    (not supported)."""
    zero_quantized_weights: bool = False
    """ZeRO++ quantized weight all-gather; must stay false (not supported)."""
    zero_quantized_gradients: bool = False
    """ZeRO++ quantized gradient reduction; must stay false (not supported)."""

    def validate(self, path: str) -> None:
        """Optimizer offload moves the sharded optimizer's state: there is none at stage 0."""
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise config_error(f"{path}.offload_optimizer.device", "needs ZeRO stage 1 or higher",
                               self.offload_optimizer.device,
                               "set zero_optimization.stage to 1 or 2, or offload_optimizer.device to 'none'")
        off = self.offload_optimizer
        if off.overlap_step and off.delayed_param_update:
            raise config_error(f"{path}.offload_optimizer.overlap_step", "the delayed update already runs "
                               "the CPU step beside the next forward and backward", off.overlap_step,
                               "set overlap_step or delayed_param_update to false", cls=NotSupportedError)
        if off.delayed_param_update and off.ratio != 1.0:
            raise config_error(f"{path}.offload_optimizer.ratio", "a partial offload cannot delay the "
                               "update (the device's share steps at the boundary)", off.ratio,
                               "set ratio to 1.0 or delayed_param_update to false", cls=NotSupportedError)


@dataclass(frozen=True)
class CompressionConfig:
    """Gradient compression applied before the data-parallel reduction."""

    type: Literal["none", "topk", "powersgd", "onebit", "fp16", "bf16", "auto"] = "none"
    """Compression method: topk sends each bucket's largest entries as (index, value) pairs;
    powersgd sends rank-`rank` factors of each weight matrix (small and 1-D tensors densely);
    onebit (1-bit Adam, at ZeRO 0-3) reduces densely for warmup_steps, then sends one bit per
    element and one scale per rank's slice, and freezes Adam's variance from then on (Adam or
    AdamW only);
    fp16/bf16 reduce in that dtype (the same as communication_data_type). auto: the Ray driver
    chooses for the whole group (dense, bf16, topk at topk_ratio, powersgd at rank, onebit's
    momentum form) among those whose recorded quality gap is within max_quality_loss, from the
    measured link and step-time split, and may change it between steps; without a driver, auto
    reduces densely. Any other type is pinned. Engines switch it between steps with
    `Engine.set_gradient_compression`."""
    topk_ratio: float = checked(0.01, gt=0, le=1)
    """topk: fraction of each bucket's gradient elements sent per reduction."""
    topk_values: Literal["fp32", "bf16", "int8"] = "fp32"
    """topk: how the kept values travel: fp32, bf16, or int8 with one scale per 256 values; what
    the rounding loses stays in the error-feedback residual."""
    topk_indices: Literal["int32", "block16"] = "int32"
    """topk: how the kept positions travel: int32, or block16 (16-bit offsets within blocks of
    65,536 elements, 2 bytes per kept element). int8 + block16: 3 bytes per element, not 8."""
    rank: int = checked(1, ge=1)
    """powersgd: rank of the low-rank approximation (capped per matrix at min(rows, cols))."""
    warmup_steps: int = checked(0, ge=0)
    """topk: optimizer steps over which the density falls exponentially from 1.0 to topk_ratio
    (Deep Gradient Compression's warm-up); powersgd: optimizer steps reduced densely first
    (torch's start_powerSGD_iter); onebit: steps reduced densely while Adam's variance is
    estimated (1-bit Adam's freeze_step, at least 1; overflowed steps do not count); 0:
    compress from the first step."""
    error_feedback: bool = True
    """topk, powersgd, onebit: carry the unsent remainder (fp32, per rank and bucket) into the
    next reduction."""
    form: Literal["auto", "momentum", "gradient"] = "auto"
    """onebit: what travels at one bit after the warm-up. momentum: each rank's momentum, as in
    1-bit Adam (the form that stays closest to dense Adam; ZeRO stages 0-2, AdamW or Adam
    without weight_decay, no delayed_param_update, no tensor or pipeline split; each rank's
    gradient is clipped by its own norm before the exchange). gradient: each rank's gradient, averaged by the shard owners,
    which works at every stage but loses more quality. auto: momentum where it can run, else
    gradient."""
    update_bound: bool = True
    """onebit: once the variance is frozen, read each element's variance as at least its
    momentum's square (E[g^2] >= E[g]^2), so that no element moves more than the learning rate
    in a step. A variance frozen while an element's gradients were small otherwise multiplies
    its later updates (30-80x Adam's largest, measured on an LM's embeddings and attention
    weights). false: 1-bit Adam's update as published."""
    max_quality_loss: Optional[float] = checked(0.03, ge=0)
    """auto: the driver never tries a setting whose recorded validation-loss gap against dense
    exceeds this fraction (cluster/quality_record.py); null: no limit."""

    def validate(self, path: str) -> None:
        """onebit freezes the variance its warm-up estimated: there must be a warm-up."""
        if self.type == "onebit" and self.warmup_steps < 1:
            raise config_error(f"{path}.warmup_steps", "onebit needs a dense warm-up",
                               self.warmup_steps, "at least 1 (1-bit Adam freezes the variance "
                               "it estimates; a few hundred steps is usual)")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """Recompute activations in backward instead of storing them."""

    enabled: bool = False
    """Turn activation checkpointing on."""
    module_pattern: Optional[str] = None
    """Regex fully matching qualified module names (`blocks\\.\\d+`) selecting the checkpointed
    blocks; None: every child of every nn.ModuleList (hybrid_ray/engine/activation_checkpointing.py)."""
    number_checkpoints: Optional[int] = checked(None, ge=1)
    """Checkpoint only this many of the selected modules, evenly spaced (None: all of them)."""
    cpu_checkpointing: bool = False
    """Keep the checkpointed blocks' saved inputs in host memory."""
    partition_activations: bool = False
    """Shard checkpointed activations across model-parallel ranks (not supported: needs TP)."""
    contiguous_memory_optimization: bool = False
    """Copy checkpoints into one contiguous buffer to limit fragmentation (no effect here)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary (debugging; no effect here)."""
    profile: bool = False
    """Time the checkpoint forward/recompute (no effect here; use torch.profiler)."""

    def validate(self, path: str) -> None:
        """The module pattern must compile."""
        if self.module_pattern is not None:
            check_regex(self.module_pattern, f"{path}.module_pattern")


@dataclass(frozen=True)
class PipelineConfig:
    """How a PipelineModule split into stages runs the micro-batches of a step."""

    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    """1f1b: each stage alternates one forward and one backward once the pipeline is full, so it
    holds the activations of at most as many micro-batches as there are stages; gpipe: every
    forward, then every backward (activations of every micro-batch held); interleaved_1f1b: 1f1b
    over the several stages each rank holds (stages_per_rank), which shortens the pipeline's
    fill and drain by that factor for more point-to-point messages."""
    micro_batches: Optional[int] = checked(None, ge=1)
    """Micro-batches per step; when set it must equal gradient_accumulation_steps (None: that)."""
    stages_per_rank: int = checked(1, ge=1)
    """Stages each rank of a pipeline holds: the layers are cut into pipeline_model_parallel_size
    * stages_per_rank stages and rank r of a pipeline holds stages r, r + P, r + 2P, ... (the
    looped placement of Megatron and torchtitan). More than one needs schedule interleaved_1f1b."""
    partition_method: Optional[str] = None
    """How the layers are cut into stages: 'parameters' (balanced parameter counts), 'uniform'
    (balanced layer counts) or 'type:<regex>' (balanced counts of the layers whose class name
    matches); None: the PipelineModule's own partition_method (DeepSpeed's default 'parameters')."""

    def validate(self, path: str) -> None:
        """The interleaved schedule and several stages per rank go together; the partition
        method must be one the PipelineModule knows."""
        if (self.schedule == "interleaved_1f1b") != (self.stages_per_rank > 1):
            raise config_error(f"{join_path(path, 'schedule')}, {join_path(path, 'stages_per_rank')}",
                               "contradiction", Verbatim(f"{self.schedule!r} with {self.stages_per_rank}"),
                               "interleaved_1f1b runs several stages per rank, 1f1b and gpipe one: "
                               "set stages_per_rank >= 2 with interleaved_1f1b, else 1")
        check_partition_method(self.partition_method, join_path(path, "partition_method"))


def check_partition_method(method: Optional[str], path: str) -> None:
    """'parameters', 'uniform' or 'type:<regex>' (any case, as DeepSpeed reads it); None passes."""
    if method is None or method.lower() in ("parameters", "uniform"):
        return
    if method.lower().startswith("type:"):
        check_regex(method[5:], path)
        return
    raise config_error(path, "unknown partition method", method,
                       "allowed: 'parameters', 'uniform', 'type:<regex>'")


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """One-shot flops/latency profile of a training step."""

    enabled: bool = False
    """Turn the profiler on."""
    profile_step: int = checked(1, ge=1)
    """Profile the training micro-step that starts after this many optimizer steps (the first
    step warms up, as in DeepSpeed); its flops are counted and the next micro-step is timed."""
    module_depth: int = checked(-1, ge=-1)
    """Depth of the per-module report; -1 means all levels."""
    top_modules: int = checked(1, ge=1)
    """Number of top modules listed in the aggregate report."""
    detailed: bool = True
    """Print the per-module breakdown."""
    output_file: Optional[str] = None
    """Write the report here (rank 0) instead of printing it."""


@dataclass(frozen=True)
class PrecisionStep:
    """One entry of a precision schedule."""

    step: int = checked(ge=1)
    """Optimizer step from which `dtype` applies."""
    dtype: Dtype = checked()
    """The model's base compute dtype from that step on."""


@dataclass(frozen=True)
class PrecisionConfig:
    """Per-module dtypes and precision rules on top of fp16/bf16 (our section, not DeepSpeed's)."""

    modules: dict[str, Dtype] = field(default_factory=dict)
    """Regex on module qualified name -> dtype that module stores params and computes in."""
    norms_fp32: bool = True
    """Normalisation layers keep fp32 params and compute."""
    norm_activations: Literal["fp32", "half"] = "fp32"
    """What an fp32 norm takes and returns under fp16/bf16. fp32: activations are cast to fp32
    in and back out (autocast's rule). half: they stay in the half dtype and torch's LayerNorm
    kernel still computes mean and variance in fp32, saving four full-activation casts per norm
    per step (about 5% of a 1.3B GPT step on an H200). The parameters stay fp32 masters; on CUDA,
    whose kernel needs one dtype, they are cast to the half dtype for the kernel as every matmul
    weight is. Other norm types keep fp32 activations."""
    fp32_outputs: bool = True
    """Floating outputs of engine forward are cast to fp32, so the loss is computed in fp32."""
    schedule: tuple[PrecisionStep, ...] = ()
    """Base compute dtype changes at these optimizer steps (strictly ascending)."""
    max_consecutive_skipped_steps: int = checked(10, ge=1)
    """bf16/fp32 runs skip steps with inf/NaN gradients and stop after this many in a row."""

    def validate(self, path: str) -> None:
        """Module regexes compile; schedule steps strictly ascend."""
        for pattern in self.modules:
            check_regex(pattern, join_path(f"{path}.modules", pattern))
        for i in range(1, len(self.schedule)):
            prev, cur = self.schedule[i - 1].step, self.schedule[i].step
            if cur <= prev:
                raise config_error(f"{path}.schedule[{i}].step", "not ascending",
                                   cur, f"must be > {prev} (the previous entry's step)")

    @property
    def uses_fp16(self) -> bool:
        """True if any module or schedule entry computes in fp16 (loss scaling then applies)."""
        return "fp16" in self.modules.values() or any(s.dtype == "fp16" for s in self.schedule)
