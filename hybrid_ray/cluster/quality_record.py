"""What each compression setting has been measured to cost in validation loss, for the driver.

The `auto` policy (compression_policy.py) never tries a setting whose recorded gap against dense
exceeds the job's `gradient_compression.max_quality_loss`. A record holds the gap measured for a
setting (the loss after the same steps, against dense) and where it came from; where several
records fit a setting, the worst counts.

Two sources. The yardstick (`jobs/compression_quality.py --config jobs/configs/quality.json`:
the job's model, optimizer and schedule, 3000 steps, 3 seeds, text that never repeats), whose
gap is the worst seed's loss against dense's best seed (the bar of issue 21: the margin holds
beyond the seeds' spread). And the LM job's 600-step runs of 2026-12-01 (one seed, one corpus
repeated), kept where the yardstick has not measured the setting. A setting with no record is
allowed, and the policy's reason says its quality was never measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

_LM_600 = "LM job, 600 steps, 2 workers, seed 1234 (BENCHMARKS.md, 2026-12-01)"
_YARD = ("the yardstick, 3000 steps, 2 simulated ranks, the worst of seeds 1234-1236 against dense's "
         "best (BENCHMARKS.md, 2026-12-05)")
_YARD_BOUND = _YARD + "; 4 ranks +0.8%, seeds 1237-1239 -2.1%"

# The keys of a setting, beyond its method's parameter, that change what a record says about it,
# with the config's defaults (CompressionConfig).
OPTION_DEFAULTS: Dict[str, Any] = {"topk_values": "fp32", "topk_indices": "int32", "form": "auto",
                                   "update_bound": True}
_TOPK = (("topk_values", "fp32"), ("topk_indices", "int32"))


@dataclass(frozen=True)
class QualityRecord:
    type: str
    param: Optional[float]  # topk: topk_ratio; powersgd: rank; onebit: None
    warmup_steps: int
    gap: float  # validation loss against dense, minus 1 (inf: it did not learn)
    source: str
    options: Tuple[Tuple[str, Any], ...] = ()  # (key, value) the setting must have for this record


RECORDS = (
    QualityRecord("topk", 0.01, 0, math.inf, _LM_600 + ": train loss flat at the unigram's", _TOPK),
    QualityRecord("topk", 0.01, 200, 0.074, _LM_600, _TOPK),
    QualityRecord("topk", 0.05, 100, 0.039, _LM_600, _TOPK),
    QualityRecord("powersgd", 4, 0, 0.085, _LM_600),
    QualityRecord("topk", 0.01, 200, 0.246, _YARD, _TOPK),
    QualityRecord("topk", 0.05, 200, 0.143, _YARD, (("topk_values", "int8"), ("topk_indices", "block16"))),
    QualityRecord("onebit", None, 200, 0.011, _YARD_BOUND, (("form", "momentum"), ("update_bound", True))),
    QualityRecord("onebit", None, 200, 0.086, _YARD, (("form", "gradient"), ("update_bound", True))),
    QualityRecord("onebit", None, 200, 0.190, _YARD + " (1-bit Adam as published)",
                  (("form", "momentum"), ("update_bound", False))),
    QualityRecord("onebit", None, 200, 0.454, _YARD + " (as published)",
                  (("form", "gradient"), ("update_bound", False))),
)


def recorded_gap(setting: Dict) -> Optional[Tuple[float, str]]:
    """(gap, source) for a setting, or None when none was measured. Of the records of the same
    method, parameter and options, those with the longest warm-up not longer than the setting's
    count (a longer warm-up does not make quality worse), and of those the worst gap."""
    kind = setting.get("type", "none")
    if kind == "topk":
        param = setting.get("topk_ratio", 0.01)
    elif kind == "powersgd":
        param = setting.get("rank", 1)
    elif kind == "onebit":
        param = None
    else:
        return None
    warmup = setting.get("warmup_steps", 0)
    same = [r for r in RECORDS if r.type == kind and r.param == param and r.warmup_steps <= warmup
            and all(setting.get(k, OPTION_DEFAULTS[k]) == v for k, v in r.options)]
    if not same:
        return None
    longest = max(r.warmup_steps for r in same)
    worst = max((r for r in same if r.warmup_steps == longest), key=lambda r: r.gap)
    return worst.gap, worst.source
