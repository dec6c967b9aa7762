"""The top-level `Config` and batch-size resolution.

Batch sizes are resolved against the data-parallel size only when it is known (at engine start,
and again after an elastic resize), so the same config file serves any world size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybrid_ray.config.checkpoint import CheckpointConfig
from hybrid_ray.config.fault_tolerance import FaultToleranceConfig
from hybrid_ray.config.compat_sections import (AmpConfig, CSVMonitorConfig, ElasticityConfig,
                                               TensorBoardConfig, WandbConfig)
from hybrid_ray.config.errors import ConfigError, NotSupportedError, Verbatim, config_error
from hybrid_ray.config.loader import checked, flatten, to_plain
from hybrid_ray.config.optim import OptimizerConfig, SchedulerConfig
from hybrid_ray.config.sections import (ActivationCheckpointingConfig, BF16Config,
                                        CompressionConfig, Dtype, FlopsProfilerConfig, PipelineConfig,
                                        FP16Config, PrecisionConfig, ZeroConfig)

_BATCH = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """Batch sizes after resolving the config against a data-parallel size."""

    train_batch_size: int
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-batches accumulated per optimizer step."""


@dataclass(frozen=True)
class Config:
    """A whole training config: DeepSpeed's keys plus our `precision` section."""

    train_batch_size: Optional[int] = checked(None, ge=1)
    """Samples per optimizer step over all data-parallel ranks (see resolve_batch)."""
    train_micro_batch_size_per_gpu: Optional[int] = checked(None, ge=1)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: Optional[int] = checked(None, ge=1)
    """Micro-batches accumulated before each optimizer step."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer run on the fp32 master weights."""
    scheduler: Optional[SchedulerConfig] = None
    """Learning-rate schedule; None keeps the optimizer's lr constant."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 mixed precision and its loss scaler."""
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 mixed precision."""
    gradient_clipping: float = checked(0.0, ge=0)
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    communication_data_type: Optional[Dtype] = None
    """dtype gradients are reduced in; None means fp32."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO sharding of optimizer state, gradients and parameters."""
    gradient_compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Compression of gradients before the data-parallel reduction."""
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    """Recomputing activations in backward."""
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    """One-shot flops/latency profile."""
    tensor_model_parallel_size: int = checked(1, ge=1)
    """Tensor-parallel group size."""
    pipeline_model_parallel_size: int = checked(1, ge=1)
    """Pipeline-parallel stage count."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """The schedule of a PipelineModule's stages."""
    steps_per_print: int = checked(10, ge=1)
    """Log progress every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately (adds device syncs)."""
    seed: Optional[int] = checked(None, ge=0, le=2**32 - 1)
    """Random seed for torch/numpy/python; None leaves them unseeded. numpy caps it at 2**32-1."""
    dump_state: bool = False
    """Print the engine state after initialisation."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before their reduction (DeepSpeed); the reducer
    already does so whenever it reduces in 16 bits, where it matters: no effect here."""
    gradient_predivide_factor: float = checked(1.0, gt=0)
    """Divide by this before the reduction and by world_size/factor after (DeepSpeed); the same
    mean either way, and the reducer picks the order: no effect here."""
    sparse_gradients: bool = False
    """Reduce nn.Embedding gradients as sparse tensors (not supported: must stay false)."""
    zero_allow_untested_optimizer: bool = False
    """DeepSpeed's opt-in to client optimizers under ZeRO; every torch optimizer is accepted here."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed's CPU-Adam requirement for offload; the engine picks torch's fused CPU step."""
    amp: AmpConfig = field(default_factory=AmpConfig)
    """apex AMP (must stay disabled: use fp16 or bf16)."""
    elasticity: ElasticityConfig = field(default_factory=ElasticityConfig)
    """DeepSpeed elasticity (must stay disabled: the Ray driver resizes jobs)."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard monitor (must stay disabled: metrics go to MLflow)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases monitor (must stay disabled: metrics go to MLflow)."""
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    """CSV monitor (must stay disabled: metrics go to MLflow and metrics.jsonl)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Per-module dtypes and precision rules (ours, not DeepSpeed's)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Asynchronous checkpoint saves and retention (ours, not DeepSpeed's)."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Copies of each rank's shard in another rank's memory, for recovery without a disk read."""

    def validate(self, path: str) -> None:
        """Cross-section rules that no single section can check."""
        if self.fp16.enabled and self.bf16.enabled:
            raise config_error("fp16.enabled, bf16.enabled", "contradiction",
                               Verbatim("both true"), "enable at most one")
        self._validate_replicas()
        self._validate_onebit()
        kind, comm = self.gradient_compression.type, self.communication_data_type
        if kind in ("fp16", "bf16") and comm is not None and comm != kind:
            raise config_error("gradient_compression.type, communication_data_type", "contradiction",
                               Verbatim(f"{kind!r} and {comm!r}"),
                               "gradient_compression fp16/bf16 sets the reduction dtype: leave "
                               "communication_data_type unset or equal to it")

    def _validate_onebit(self) -> None:
        if self.gradient_compression.type != "onebit":
            return
        if self.optimizer.type not in ("Adam", "AdamW") or self.optimizer.params.get("amsgrad"):
            raise config_error("gradient_compression.type, optimizer.type", "onebit freezes Adam's variance",
                               Verbatim(f"'onebit' with {self.optimizer.type}"
                                        + (" (amsgrad)" if self.optimizer.params.get("amsgrad") else "")),
                               "use Adam or AdamW without amsgrad, or another compression type",
                               cls=NotSupportedError)
        why = self.onebit_momentum_obstacle()
        if why and self.gradient_compression.form == "momentum":
            raise config_error("gradient_compression.form", f"the momentum form cannot run with {why}",
                               "momentum", "use form 'gradient' (or 'auto')", cls=NotSupportedError)

    def onebit_momentum_obstacle(self) -> str:
        """Why onebit's momentum form cannot run with this config ('' when it can): every rank
        needs its whole window gradient (stages 0-2) and the whole model's norm for its clip (no
        tensor or pipeline split), the owner's momentum must be current when
        the exchange reads it (no delayed update), and Adam's L2 decay would enter the gradient
        after the momentum is formed (AdamW's decoupled decay is applied at the step)."""
        zero = self.zero_optimization
        if zero.stage >= 3:
            return f"ZeRO stage {zero.stage} (stages 0-2 only)"
        if self.tensor_model_parallel_size > 1 or self.pipeline_model_parallel_size > 1:
            return "tensor or pipeline parallelism (each rank clips by its own norm: a replica's spans ranks)"
        if zero.offload_optimizer.delayed_param_update:
            return "offload_optimizer.delayed_param_update"
        if self.optimizer.type == "Adam" and self.optimizer.params.get("weight_decay"):
            return "Adam's weight_decay (use AdamW)"
        return ""

    def _validate_replicas(self) -> None:
        split = self.tensor_model_parallel_size > 1 or self.pipeline_model_parallel_size > 1
        if self.fault_tolerance.spare_workers and split:
            raise config_error("fault_tolerance.spare_workers", "not supported with tensor or pipeline "
                               "parallelism yet", self.fault_tolerance.spare_workers, "set it to 0",
                               cls=NotSupportedError)
        if not self.fault_tolerance.replicas:
            return
        if self.tensor_model_parallel_size > 1 or self.pipeline_model_parallel_size > 1:
            raise config_error("fault_tolerance.replicas", "not supported with tensor or pipeline "
                               "parallelism yet", self.fault_tolerance.replicas,
                               "set it to 0 (a lost worker's replica resumes from the newest checkpoint)",
                               cls=NotSupportedError)
        off = self.zero_optimization.offload_optimizer
        for key in ("delayed_param_update", "overlap_step"):  # both step the masters off the main thread
            if getattr(off, key):
                raise config_error(f"fault_tolerance.replicas, zero_optimization.offload_optimizer.{key}",
                                   "not supported together yet", Verbatim("both set"),
                                   "turn one of them off", cls=NotSupportedError)

    @property
    def base_dtype(self) -> str:
        """The model's base compute dtype: 'fp16', 'bf16' or 'fp32'."""
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict:
        """Plain nested JSON-able dict with every field; load_config(cfg.to_dict()) == cfg."""
        return to_plain(self)

    def flat_dict(self) -> dict[str, object]:
        """{'zero_optimization.stage': 2, ...} with scalar values, for logging as run params."""
        return flatten(self.to_dict())

    def data_parallel_size(self, world_size: int) -> int:
        """world / (tensor * pipeline): the ranks that each hold a whole model replica's share."""
        per_replica = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % per_replica:
            raise config_error("tensor_model_parallel_size", "does not fit the world size",
                               Verbatim(f"{self.tensor_model_parallel_size} * pipeline_model_parallel_size "
                                        f"{self.pipeline_model_parallel_size} with world size {world_size}"),
                               "allowed: a product that divides the world size")
        return world_size // per_replica

    def resolve_batch(self, dp_size: int) -> BatchSizes:
        """Apply train_batch_size = micro * gradient_accumulation_steps * dp_size (DeepSpeed)."""
        return resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps, dp_size)


def check_batch(cfg: Config, fixed_global_batch: bool = False) -> None:
    """Refuse, at load time, batch sizes that resolve_batch refuses at every data-parallel size.

    train_batch_size = micro * gas * dp_size has a solution dp_size >= 1 exactly when
    train_batch_size is a multiple of the sizes given beside it; which dp_size does is known
    only at engine start (resolve_batch). With fixed_global_batch (the LM job's rule: the
    micro-batch is an upper bound, lm/job.for_world) any train_batch_size fits one rank.
    """
    batch, micro, gas = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                         cfg.gradient_accumulation_steps)
    if batch is None and micro is None:
        raise _missing()
    if batch is None or fixed_global_batch:
        return
    if micro is not None and gas is not None and batch % (micro * gas):
        raise config_error(
            f"{_BATCH}, {_MICRO}, {_GAS}", "contradiction",
            Verbatim(f"{batch}, {micro}, {gas} ({batch} is not a multiple of {micro} * {gas})"),
            f"need {_BATCH} = {_MICRO} * {_GAS} * dp_size for some data-parallel size dp_size")
    given = micro if gas is None else gas  # the one beside train_batch_size, if only one
    if (micro is None) != (gas is None) and batch % given:
        key = _MICRO if gas is None else _GAS
        raise config_error(f"{_BATCH}, {key}", "not divisible", Verbatim(f"{batch}, {given}"),
                           f"need {_BATCH} divisible by {key} = {given} (whatever the "
                           f"data-parallel size)")


def _missing() -> ConfigError:
    return config_error(f"{_BATCH}, {_MICRO}", "missing", Verbatim("neither"),
                        f"set at least one ({_GAS} alone cannot size the batch)")


def resolve_batch(batch: Optional[int], micro: Optional[int], gas: Optional[int],
                  dp_size: int) -> BatchSizes:
    """Infer the missing batch sizes; any two given determine the third, as in DeepSpeed.

    Only micro given -> gas 1; only train_batch_size given -> gas 1, micro = batch / dp_size.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise config_error("dp_size", "out of range", dp_size, "allowed: an integer >= 1")
    if batch is None and micro is None:
        raise _missing()
    if micro is None and gas is None:
        gas = 1
        micro = _divide(batch, dp_size, _BATCH, f"{batch} with dp_size {dp_size}", "dp_size")
    elif micro is None:
        micro = _divide(batch, gas * dp_size, f"{_BATCH}, {_GAS}",
                        f"{batch}, {gas} with dp_size {dp_size}", f"{_GAS} * dp_size")
    elif batch is None:
        gas = 1 if gas is None else gas
        batch = micro * gas * dp_size
    elif gas is None:
        gas = _divide(batch, micro * dp_size, f"{_BATCH}, {_MICRO}",
                      f"{batch}, {micro} with dp_size {dp_size}", f"{_MICRO} * dp_size")
    if batch != micro * gas * dp_size:
        raise config_error(
            f"{_BATCH}, {_MICRO}, {_GAS}", "contradiction",
            Verbatim(f"{batch}, {micro}, {gas} with dp_size {dp_size} "
                     f"({micro} * {gas} * {dp_size} = {micro * gas * dp_size})"),
            f"need {_BATCH} = {_MICRO} * {_GAS} * dp_size")
    return BatchSizes(batch, micro, gas)


def _divide(total: int, divisor: int, keys: str, got: str, divisor_words: str) -> int:
    """total / divisor when it is a whole number >= 1, else a ConfigError naming the keys."""
    if total % divisor:
        raise config_error(keys, "not divisible", Verbatim(got),
                           f"need {_BATCH} divisible by {divisor_words} = {divisor}")
    return total // divisor

