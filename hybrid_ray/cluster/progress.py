"""Live progress on the driver: a rich progress bar in a terminal, plain lines in a log.

Fed by the controller: `record(rec)` for every metrics record rank 0 reports (step, loss,
tokens/s, loss scale, world size, ...), `event(msg)` for membership news ("worker 2 lost,
re-forming at 3 workers ..."). Under `ray job submit` stdout is a pipe: one line per
`log_every` steps then, so the job's logs show progress without escape codes.
"""
from __future__ import annotations

import time
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _fmt(rec: dict) -> str:
    parts = []
    rec = dict(rec, loss=rec.get("loss", rec.get("train_loss")))
    for key, label, spec in (("loss", "loss", ".4f"), ("val_loss", "val", ".4f"),
                             ("tokens_per_s", "tok/s", ",.0f"), ("loss_scale", "scale", "g"),
                             ("world_size", "workers", "d")):
        if rec.get(key) is not None:
            parts.append(f"{label} {rec[key]:{spec}}")
            if key == "val_loss" and rec.get("val_step") not in (None, rec.get("step")):
                parts[-1] += f" (step {rec['val_step']})"  # an evaluation older than the line
    return " | ".join(parts)


class ProgressReporter:
    def __init__(self, total_steps: Optional[int] = None, console: Optional[Console] = None,
                 log_every: int = 10):
        self.console = console or Console()
        self.total, self.log_every = total_steps, log_every
        self.live = self.console.is_terminal
        self._last = {}
        self._progress = None
        self._task = None
        self._t0 = time.monotonic()
        if self.live:
            self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                      console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, info="starting")
            self._progress.start()

    def record(self, rec: dict) -> None:
        """A step's metrics: in a log, a line per training record at every log_every-th step
        and at the last one, and a line per evaluation; other records (the final numbers, a
        recovery time) only update what the next line shows."""
        self._last.update({k: v for k, v in rec.items() if v is not None})
        step = rec.get("step")
        if step is None:
            return
        if rec.get("val_loss") is not None:
            self._last["val_step"] = step
        if self.live:
            self._progress.update(self._task, completed=step, info=_fmt(self._last))
            return
        total = f"/{self.total}" if self.total else ""
        elapsed = f"{time.monotonic() - self._t0:.0f} s"
        if rec.get("val_loss") is not None:
            self.console.print(f"eval step {step}{total} | val {rec['val_loss']:.4f} | {elapsed}",
                               highlight=False, soft_wrap=True)
        elif ("loss" in rec or "train_loss" in rec) and \
                (step % self.log_every == 0 or (self.total and step == self.total)):
            self.console.print(f"step {step}{total} | {_fmt(self._last)} | {elapsed}",
                               highlight=False, soft_wrap=True)

    def event(self, msg: str) -> None:
        self.console.print(f"[bold yellow]event[/]: {msg}" if self.live else f"event: {msg}",
                           highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
