"""The names the LM job's metrics have in MLflow, and which ones it leaves out.

Workers report short names (`train_loss`, `tokens_per_s`: metrics.jsonl keeps them); MLflow
gets them under a prefix per concern, so its UI groups the charts: `train/` (loss, lr, gradient
norm), `val/`, `perf/` (throughput, FLOP/s, memory), `comm/` (gradient traffic and
compression), `elastic/` (world size, recovery), `final/` (the closing numbers); `system/` and
`events/` are named where they are made. A series that is constant by construction is not
logged at all: a chart of a flat line only pushes the ones that move down the page.
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional

from hybrid_ray.lm.job import uses_fp16
from hybrid_ray.tracking.values import metric_value

NAMES: Dict[str, str] = {
    "train_loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale", "skipped_steps": "train/skipped_steps",
    "samples": "train/samples",
    "val_loss": "val/loss",
    "tokens_per_s": "perf/tokens_per_s", "samples_per_s": "perf/samples_per_s",
    "step_time_s": "perf/step_time_s", "tflops": "perf/tflops", "mfu": "perf/mfu",
    "mem_allocated_gib": "perf/mem_allocated_gib", "mem_peak_gib": "perf/mem_peak_gib",
    "grad_bytes_sent": "comm/grad_bytes_sent", "compression_ratio": "comm/compression_ratio",
    "step_s": "comm/step_s", "comm_wait_s": "comm/wait_s", "compress_s": "comm/compress_s",
    "compression_id": "comm/compression_id", "interval_steps": "comm/interval_steps",
    "interval_step_s": "comm/interval_step_s", "interval_comm_s": "comm/interval_comm_s",
    "world_size": "elastic/world_size", "recovery_s": "elastic/recovery_s",
    "final_val_loss": "final/val_loss", "unigram_baseline": "final/unigram_baseline",
    "failures": "final/failures",
}
_NOT_METRICS = ("step", "val_step")
_DENSE_ONLY_CONSTANT = ("grad_bytes_sent", "compression_ratio", "compress_s")


def constant_by_construction(fp16: bool, compressed: bool, fixed_world: bool) -> FrozenSet[str]:
    """Short names whose value cannot change in such a run: the loss scale outside fp16 (1),
    gradient traffic and compression numbers without compression (the same bytes every step,
    ratio 1, no compression time), the world size of a group that cannot resize."""
    out = set() if fp16 else {"loss_scale"}
    if not compressed:
        out.update(_DENSE_ONLY_CONSTANT)
    if fixed_world:
        out.add("world_size")
    return frozenset(out)


class MetricNames:
    """Turns a record's short names into MLflow names, leaving out the constant ones."""

    def __init__(self, constant: Iterable[str] = ()):
        self.constant = frozenset(constant)

    @classmethod
    def for_job(cls, job: Any, fixed_world: bool) -> "MetricNames":
        compressed = job.engine.gradient_compression.type != "none"
        return cls(constant_by_construction(uses_fp16(job.engine), compressed, fixed_world))

    def __call__(self, metrics: Mapping[str, Any]) -> Dict[str, float]:
        out = {}
        for name, value in metrics.items():
            if name in _NOT_METRICS or name in self.constant:
                continue
            number = metric_value(value)
            if number is not None:
                out[mlflow_name(name)] = number
        return out


def mlflow_name(name: str) -> str:
    """The MLflow name of a short name (a name with a prefix, or one not in NAMES, as given)."""
    return NAMES.get(name, name)


def short_name(mlflow: str) -> Optional[str]:
    """The short name an MLflow name came from (None for names made elsewhere)."""
    for short, full in NAMES.items():
        if full == mlflow:
            return short
    return None
