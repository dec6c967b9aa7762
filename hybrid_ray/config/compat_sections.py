"""DeepSpeed sections that official examples set to their off values: accepted as written,
refused with NotSupportedError when switched on (api._check_supported), since what they turn on
lives elsewhere here (precision: fp16/bf16; elastic scaling: the Ray driver; metrics: MLflow).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybrid_ray.config.loader import checked


@dataclass(frozen=True)
class AmpConfig:
    """NVIDIA apex AMP (not supported: use fp16 or bf16)."""

    enabled: bool = False
    """Train with apex AMP; must stay false."""
    opt_level: Optional[str] = None
    """apex's optimisation level (O0-O3), read only when enabled."""


@dataclass(frozen=True)
class ElasticityConfig:
    """DeepSpeed elasticity (not supported: the Ray driver resizes jobs, `hybrid-ray train --min-workers`)."""

    enabled: bool = False
    """Choose batch sizes that stay valid over a range of GPU counts; must stay false."""
    max_train_batch_size: Optional[int] = checked(None, ge=1)
    """Largest global batch elasticity may choose."""
    micro_batch_sizes: tuple[int, ...] = ()
    """Micro-batch sizes elasticity may choose from."""
    min_gpus: Optional[int] = checked(None, ge=1)
    """Fewest GPUs the job may run on."""
    max_gpus: Optional[int] = checked(None, ge=1)
    """Most GPUs the job may run on."""
    min_time: int = checked(0, ge=0)
    """Minimum running time before a scaling decision (minutes)."""
    version: float = 0.1
    """Elasticity algorithm version."""
    ignore_non_elastic_batch_info: bool = False
    """Ignore the batch keys outside this section."""
    prefer_larger_batch: bool = True
    """Prefer the larger of equally good batch sizes."""
    num_gpus_per_node: int = checked(1, ge=1)
    """GPUs per node, for elasticity version 0.2."""
    model_parallel_size: int = checked(1, ge=1)
    """Model-parallel size, for elasticity version 0.2."""


@dataclass(frozen=True)
class TensorBoardConfig:
    """DeepSpeed's TensorBoard monitor (not supported: metrics go to MLflow, hybrid_ray.tracking)."""

    enabled: bool = False
    """Write TensorBoard events; must stay false."""
    output_path: str = ""
    """Folder for the event files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-folder name of this run."""


@dataclass(frozen=True)
class CSVMonitorConfig:
    """DeepSpeed's CSV monitor (not supported: metrics go to MLflow and metrics.jsonl)."""

    enabled: bool = False
    """Write CSV files of the metrics; must stay false."""
    output_path: str = ""
    """Folder for the CSV files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-folder name of this run."""


@dataclass(frozen=True)
class WandbConfig:
    """DeepSpeed's Weights & Biases monitor (not supported: metrics go to MLflow)."""

    enabled: bool = False
    """Log to Weights & Biases; must stay false."""
    group: Optional[str] = None
    """W&B group."""
    team: Optional[str] = None
    """W&B team (entity)."""
    project: str = "deepspeed"
    """W&B project."""
