"""What each compression setting has been measured to cost in validation loss, for the driver.

The `auto` policy (compression_policy.py) never tries a setting whose recorded gap against dense
exceeds the job's `gradient_compression.max_quality_loss`. A record holds the worst gap
measured for a setting (the loss after the same steps, against dense) and where it came from.

The records are the LM job's 600-step runs of 2026-12-01 (BENCHMARKS.md, "Gradient compression:
LM quality"): few steps, one corpus repeated, one seed. The yardstick of issue 21
(`jobs/compression_quality.py --config jobs/configs/quality.json`, 3000 steps, 3 seeds, text
that never repeats) is meant to replace them; until then they are what is known. A setting
with no record is allowed, and the policy's reason says its quality was never measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

_LM_600 = "LM job, 600 steps, 2 workers, seed 1234 (BENCHMARKS.md, 2026-12-01)"


@dataclass(frozen=True)
class QualityRecord:
    type: str
    param: float  # topk: topk_ratio; powersgd: rank
    warmup_steps: int
    gap: float  # validation loss against dense, minus 1 (inf: it did not learn)
    source: str
    topk_values: str = "fp32"
    topk_indices: str = "int32"


RECORDS = (
    QualityRecord("topk", 0.01, 0, math.inf, _LM_600 + ": train loss flat at the unigram's"),
    QualityRecord("topk", 0.01, 200, 0.074, _LM_600),
    QualityRecord("topk", 0.05, 100, 0.039, _LM_600),
    QualityRecord("powersgd", 4, 0, 0.085, _LM_600),
)


def recorded_gap(setting: Dict) -> Optional[Tuple[float, str]]:
    """(gap, source) for a setting, or None when none was measured. Of the records of the same
    method, parameter and encoding, the one with the longest warm-up not longer than the
    setting's counts: a longer warm-up does not make quality worse."""
    kind = setting.get("type", "none")
    if kind == "topk":
        param = setting.get("topk_ratio", 0.01)
    elif kind == "powersgd":
        param = setting.get("rank", 1)
    else:
        return None
    warmup = setting.get("warmup_steps", 0)
    same = [r for r in RECORDS if r.type == kind and r.param == param and r.warmup_steps <= warmup
            and (kind != "topk" or (r.topk_values, r.topk_indices) ==
                 (setting.get("topk_values", "fp32"), setting.get("topk_indices", "int32")))]
    if not same:
        return None
    best = max(same, key=lambda r: r.warmup_steps)
    return best.gap, best.source
