"""How the driver chooses gradient compression for the whole group; free of Ray, tested alone.

Compression trades compute (selecting, compressing, error feedback) for bytes on the link. It
pays only when the link is the bottleneck: on NVLink a dense bf16 step spends a few percent of its
time in exposed communication, and top-k's selection costs more than the bytes it saves; over a
slow network the reduction can be most of the step. So the policy measures before it decides:

1. MEASURE: a few logging intervals with the dense reduction give the step time, the exposed
   communication per step (time blocked on gradient collectives) and the dense bytes; the
   workers also measure the link's bus bandwidth when the group forms.
2. If communication is a small share of the step, nothing can pay back: stay dense, settled.
   Otherwise predict each candidate's step time from the bytes it moves (compute unchanged,
   communication scaled by its byte ratio) and TRY the ones predicted to win, best first, each
   for a few intervals.
3. SETTLE on the fastest measured setting (dense included) and say why, with the numbers.

A trial is timed only once its compressor's dense warm-up is over (1-bit Adam's runs a couple of
hundred steps); a setting the workers' engine cannot run (1-bit Adam on SGD, at ZeRO-3) is
refused there, and the policy goes on to the next, saying why.

A new group (lost worker, resize) changes the link and the per-rank shares: everything is
measured again. A setting the user pinned is never changed. The driver turns each Decision into
a directive the workers apply at the same step (context.agree_on_directive).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple, Union

from hybrid_ray.config import CompressionConfig
from hybrid_ray.config.loader import load_dataclass, to_plain
from hybrid_ray.engine.compression.codec import PairCodec

from .quality_record import recorded_gap
from .records import Interval  # one logging interval of rank 0, as the workers report it

DENSE: Dict = {"type": "none"}
Section = Union[CompressionConfig, Mapping]


def section(auto: Section) -> CompressionConfig:
    """The validated `gradient_compression` section (a mapping goes through the config loader)."""
    if isinstance(auto, CompressionConfig):
        return auto
    return load_dataclass(CompressionConfig, auto, "gradient_compression")


def describe(setting: Section) -> str:
    """'dense', 'bf16', 'topk 0.01', 'powersgd rank 4'."""
    if isinstance(setting, CompressionConfig):
        setting = to_plain(setting)
    kind = setting.get("type", "none")
    if kind == "none":
        return "dense"
    if kind == "topk":
        return f"topk {setting.get('topk_ratio', 0.01):g}"
    if kind == "powersgd":
        return f"powersgd rank {setting.get('rank', 1)}"
    if kind == "onebit" and setting.get("form", "auto") != "auto":
        return f"onebit {setting['form']}"
    return kind


# 1-bit Adam's dense warm-up where the section sets none: the warm-up its quality was measured
# with (quality_record.py). A switch mid-run restarts it, so the variance it freezes has been
# estimated for at least this many steps.
ONEBIT_WARMUP = 200


def candidates(auto: Section) -> List[Dict]:
    """What `gradient_compression: {type: auto, ...}` lets the driver choose from: bf16, top-k at
    the section's topk_ratio (and its payload encoding), PowerSGD at its rank, each with its
    warmup_steps and error_feedback (the config's defaults where the job sets none: topk_ratio
    0.01, rank 1), and 1-bit Adam's momentum form (with update_bound; warmup_steps, or
    ONEBIT_WARMUP where that is 0). An engine that cannot run one (1-bit needs Adam or AdamW and
    ZeRO 0-2) refuses it and the driver goes on to the next (compression_follower.py)."""
    auto = section(auto)
    common = {"warmup_steps": auto.warmup_steps, "error_feedback": auto.error_feedback}
    return [{"type": "bf16"},
            {"type": "topk", "topk_ratio": auto.topk_ratio, "topk_values": auto.topk_values,
             "topk_indices": auto.topk_indices, **common},
            {"type": "powersgd", "rank": auto.rank, **common},
            {"type": "onebit", "form": "momentum", "update_bound": auto.update_bound,
             "warmup_steps": auto.warmup_steps or ONEBIT_WARMUP, "error_feedback": auto.error_feedback}]


def quality_gate(options: List[Dict], max_loss: Optional[float]) -> Tuple[List[Dict], List[str]]:
    """(the options whose recorded quality gap is within max_loss, a note for each left out or
    never measured)."""
    kept, notes = [], []
    for option in options:
        record = recorded_gap(option)
        if record is None:
            if option["type"] != "bf16":
                notes.append(f"{describe(option)}: quality never measured")
            kept.append(option)
        elif max_loss is not None and record[0] > max_loss:
            notes.append(f"{describe(option)} left out: its recorded quality gap {record[0]:+.1%} "
                         f"exceeds max_quality_loss {max_loss:.1%} ({record[1]})")
        else:
            kept.append(option)
    return kept, notes


@dataclass(frozen=True)
class Decision:
    """Put `setting` in force under `setting_id` (workers report intervals by that id; an id
    already in force changes nothing on them). reason: for the log and MLflow."""

    setting: Dict
    setting_id: int
    reason: str


@dataclass
class _Trial:
    setting: Dict
    predicted_s: float = 0.0
    samples: List[Interval] = field(default_factory=list)

    def mean_step_s(self) -> float:
        total = sum(i.steps for i in self.samples)
        return sum(i.step_s * i.steps for i in self.samples) / max(total, 1)

    def mean_comm_s(self) -> float:
        total = sum(i.steps for i in self.samples)
        return sum(i.comm_wait_s * i.steps for i in self.samples) / max(total, 1)


class CompressionPolicy:
    """observe() each interval, on_group() each new group; both may return a Decision."""

    def __init__(self, options: List[Dict], intervals: int = 2, min_comm_share: float = 0.15,
                 min_gain: float = 0.05, max_quality_loss: Optional[float] = 0.03):
        """options: the candidate settings (see `candidates`); intervals: measured intervals per
        setting (the first interval after any switch is skipped: it holds the switch and warm-up);
        min_comm_share: below this share of exposed communication, stay dense; min_gain: a
        setting must beat dense by this fraction of the step to be chosen; max_quality_loss: a
        setting whose recorded validation-loss gap exceeds it is never tried (None: any)."""
        self.options, self.quality_notes = quality_gate(options, max_quality_loss)
        self.intervals = intervals
        self.min_comm_share, self.min_gain = min_comm_share, min_gain
        self.current_id, self.current = 0, DENSE  # in force: id 0 is the job's own start (dense)
        self._ids = 0
        self._reset()

    def _reset(self) -> None:
        self.settled: Optional[Dict] = None
        self._dense = _Trial(DENSE)
        self._trying = self._dense
        self._queue: List[_Trial] = []
        self._done: List[_Trial] = []
        self._skip_first = True
        self._summary = ""
        self._refusals: List[str] = []

    # ---- inputs ------------------------------------------------------------------------------
    def on_group(self, world_size: int, bandwidth: Optional[float]) -> Optional[Decision]:
        """A group formed (world_size ranks, bus bandwidth in bytes/s if measured): measure dense
        again, switching back to it if something else is in force."""
        self.world_size, self.bandwidth = world_size, bandwidth
        self._reset()
        if world_size <= 1:  # nothing is reduced with one rank
            self.settled = DENSE
            return self._put(DENSE, "one worker: no gradient reduction") if self.current != DENSE else None
        if self.current != DENSE:
            return self._put(DENSE, f"a group of {world_size} formed: measuring the dense reduction again")
        return None

    def observe(self, iv: Interval) -> Optional[Decision]:
        """One interval of rank 0's measurements; intervals of another setting are ignored."""
        if self.settled is not None or iv.setting_id != self.current_id or iv.steps <= 0:
            return None
        if iv.refused and self._trying is not self._dense:
            self._refusals.append(f"{describe(self._trying.setting)} refused by the workers ({iv.refused})")
            return self._next_trial()
        if iv.warming:  # its warm-up reduces densely: not yet its own speed
            return None
        if self._skip_first:
            self._skip_first = False
            return None
        self._trying.samples.append(iv)
        if len(self._trying.samples) < self.intervals:
            return None
        if self._trying is self._dense:
            return self._after_dense()
        self._done.append(self._trying)
        return self._next_trial()

    # ---- the steps ----------------------------------------------------------------------------
    def _after_dense(self) -> Decision:
        step, comm = self._dense.mean_step_s(), self._dense.mean_comm_s()
        share = comm / step if step > 0 else 0.0
        link = f", link {self.bandwidth / 1e6:,.1f} MB/s" if self.bandwidth else ""
        self._summary = (f"dense {step:.3f} s/step, {comm:.3f} s of it exposed communication ({share:.0%}{link})"
                         + "".join(f"; {note}" for note in self.quality_notes))
        if share < self.min_comm_share:
            self.settled = DENSE
            return self._put(DENSE, f"keeping dense: {self._summary}; under {self.min_comm_share:.0%}, "
                                    "compression cannot pay for itself", same_id=True)
        compute = step - comm
        for option in self.options:
            predicted = compute + comm * self._byte_ratio(option)
            if predicted < step * (1 - self.min_gain):
                self._queue.append(_Trial(option, predicted))
        self._queue.sort(key=lambda t: t.predicted_s)
        return self._next_trial()

    def _byte_ratio(self, option: Dict) -> float:
        """Bytes on the wire against the dense ring all-reduce (2(n-1)/n of the buffer per rank).
        top-k all-gathers (value, index) pairs: (n-1) * 2 * ratio of the buffer per rank.
        PowerSGD's factors depend on the matrix shapes: guessed at 1/16 until measured. 1-bit
        Adam sends one bit per element where dense sends 32 (and a scale per chunk)."""
        n, kind = self.world_size, option["type"]
        if kind in ("bf16", "fp16"):
            return 0.5
        if kind == "onebit":
            return 1 / 32
        if kind == "topk":  # bytes per kept element against 4 per dense one (codec.py)
            codec = PairCodec(option.get("topk_values", "fp32"), option.get("topk_indices", "int32"))
            per_kept = codec.nbytes(1 << 20, 1 << 20) / (1 << 20) / 4
            return (n - 1) * per_kept * option.get("topk_ratio", 0.01) / (2 * (n - 1) / n)
        return 1 / 16

    def _next_trial(self) -> Decision:
        if not self._queue:
            return self._settle()
        self._trying = self._queue.pop(0)
        self._skip_first = True
        return self._put(self._trying.setting, f"trying {describe(self._trying.setting)}: "
                                               f"{self._summary}; predicted {self._trying.predicted_s:.3f} s/step")

    def _settle(self) -> Decision:
        dense_s = self._dense.mean_step_s()
        measured = "".join(f", {describe(t.setting)} {t.mean_step_s():.3f}" for t in self._done)
        best = min(self._done, key=lambda t: t.mean_step_s(), default=None)
        if best is not None and best.mean_step_s() < dense_s * (1 - self.min_gain):
            chosen, why = best, f"{dense_s / best.mean_step_s():.2f}x faster than dense"
        elif best is None:
            chosen, why = self._dense, "no setting was predicted to gain"
        else:
            chosen, why = self._dense, f"no setting beat dense by {self.min_gain:.0%}"
        self.settled = chosen.setting
        refused = "".join(f"; {r}" for r in self._refusals)
        return self._put(chosen.setting, f"settled on {describe(chosen.setting)} ({why}): {self._summary}; "
                                         f"measured s/step: dense {dense_s:.3f}{measured}{refused}",
                         same_id=chosen.setting == self.current)

    def _put(self, setting: Dict, reason: str, same_id: bool = False) -> Decision:
        """Make `setting` the one in force; a new id unless it already is (same_id)."""
        if not (same_id and setting == self.current):
            self._ids += 1
            self.current_id, self.current = self._ids, setting
        return Decision(setting, self.current_id, reason)
