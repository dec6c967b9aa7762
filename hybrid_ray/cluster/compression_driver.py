"""The driver's side of gradient-compression coordination: records in, directives out.

The workers' rank 0 reports the link bandwidth when a group forms ({"link": ...}) and, with every
logged step, the interval's mean step time, exposed communication and the setting id in force.
CompressionPolicy turns those into decisions; each becomes a directive {"id", "setting",
"reason"} for every worker (applied by all ranks at the same step), an event (log, progress,
MLflow events.log) and the `compression.setting` tag. A job that names its own
gradient_compression type is pinned: the driver only says so.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from .compression_policy import (CompressionPolicy, Decision, Interval, Section, candidates, describe,
                                 section)


class CompressionCoordinator:
    def __init__(self, settings: Section, send: Callable[[dict], None], event: Callable[[str], None],
                 tag: Callable[[str], None] = lambda setting: None, intervals: int = 2):
        """settings: the job's validated engine `gradient_compression` section; type `auto` lets
        the driver choose (from bf16, top-k at its topk_ratio, PowerSGD at its rank), any other
        is pinned. send: deliver a directive to every worker; event: say a decision and why;
        tag: record the setting now in force (MLflow tag)."""
        self.section = section(settings)
        self.auto = self.section.type == "auto"
        self.send, self.event, self.tag = send, event, tag
        self.policy = CompressionPolicy(candidates(self.section), intervals=intervals) if self.auto else None
        self._said_pinned = False

    def record(self, rec: Mapping) -> None:
        """Feed one worker record (anything else is ignored)."""
        if self.policy is None:
            self._pinned_once()
            return
        if "link" in rec:
            link = rec["link"]
            bandwidth = link.get("bandwidth")
            self._act(self.policy.on_group(int(link["world_size"]), bandwidth),
                      f"a group of {link['world_size']} formed; link "
                      + (f"{bandwidth / 1e6:,.1f} MB/s" if bandwidth else "not measured"))
        elif "compression_id" in rec and rec.get("interval_steps"):
            self._act(self.policy.observe(Interval(
                setting_id=int(rec["compression_id"]), steps=int(rec["interval_steps"]),
                step_s=float(rec["interval_step_s"]), comm_wait_s=float(rec.get("interval_comm_s") or 0.0))))

    def _act(self, decision: Optional[Decision], context: str = "") -> None:
        if decision is None:
            if context:
                self.event(f"compression: {context}")
            return
        self.send({"id": decision.setting_id, "setting": decision.setting, "reason": decision.reason})
        self.tag(describe(decision.setting))
        self.event(f"compression: {decision.reason}")

    def _pinned_once(self) -> None:
        if self._said_pinned or self.section.type == "none":
            return
        self._said_pinned = True
        self.event(f"compression: {describe(self.section)} pinned by the job; the driver leaves it")
