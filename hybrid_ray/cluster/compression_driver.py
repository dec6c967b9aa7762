"""The driver's side of gradient-compression coordination: records in, directives out.

The workers' rank 0 reports the link bandwidth when a group forms (a LinkProbe record) and, with
every logged step, the interval's mean step time, exposed communication and the setting id in
force (an Interval record).
CompressionPolicy turns those into decisions; each becomes a directive {"id", "setting",
"reason"} for every worker (applied by all ranks at the same step), an event (log, progress,
MLflow events.log) and the `compression.setting` tag. A job that names its own
gradient_compression type is pinned: the driver only says so.
"""
from __future__ import annotations

from typing import Callable, Optional

from .compression_policy import CompressionPolicy, Decision, Section, candidates, describe, section
from .records import Interval, LinkProbe


class CompressionCoordinator:
    def __init__(self, settings: Section, send: Callable[[dict], None], event: Callable[[str], None],
                 tag: Callable[[str], None] = lambda setting: None, intervals: int = 2):
        """settings: the job's validated engine `gradient_compression` section; type `auto` lets
        the driver choose (compression_policy.candidates), any other
        is pinned. send: deliver a directive to every worker; event: say a decision and why;
        tag: record the setting now in force (MLflow tag)."""
        self.section = section(settings)
        self.auto = self.section.type == "auto"
        self.send, self.event, self.tag = send, event, tag
        self.policy = CompressionPolicy(candidates(self.section), intervals=intervals,
                                        max_quality_loss=self.section.max_quality_loss) if self.auto else None

    def on_link(self, probe: LinkProbe) -> None:
        """A group formed and measured its link: the policy starts over."""
        if self.policy is None:
            return
        bandwidth = probe.bandwidth
        self._act(self.policy.on_group(probe.world_size, bandwidth),
                  f"a group of {probe.world_size} formed; link "
                  + (f"{bandwidth / 1e6:,.1f} MB/s" if bandwidth else "not measured"))

    def on_interval(self, interval: Interval) -> None:
        """Rank 0's timing of one logging interval."""
        if self.policy is not None and interval.steps:
            self._act(self.policy.observe(interval))

    def announce(self) -> None:
        """As the run starts: say that a setting the job names is pinned (the driver leaves it)."""
        if self.policy is None and self.section.type != "none":
            self.event(f"compression: {describe(self.section)} pinned by the job; the driver leaves it")

    def _act(self, decision: Optional[Decision], context: str = "") -> None:
        if decision is None:
            if context:
                self.event(f"compression: {context}")
            return
        self.send({"id": decision.setting_id, "setting": decision.setting, "reason": decision.reason})
        self.tag(describe(decision.setting))
        self.event(f"compression: {decision.reason}")
