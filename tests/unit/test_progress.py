"""The driver's progress reporter: plain lines when stdout is a log, a bar in a terminal."""
from __future__ import annotations

import io

from rich.console import Console

from hybrid_ray.cluster.progress import ProgressReporter


def test_plain_lines_in_a_log_every_n_steps_with_events() -> None:
    out = io.StringIO()
    p = ProgressReporter(total_steps=20, console=Console(file=out, force_terminal=False, width=200),
                         log_every=10)
    for step in range(1, 21):
        p.record({"step": step, "loss": 1.0 / step, "tokens_per_s": 1234.5, "world_size": 2})
    p.event("worker 1 lost; re-forming at 1 worker(s)")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 10/20 | loss 0.1000 | tok/s 1,234 | workers 2")
    assert lines[1].startswith("step 20/20 | loss 0.0500")
    assert lines[2] == "event: worker 1 lost; re-forming at 1 worker(s)"


def test_terminal_bar_shows_step_and_fields() -> None:
    out = io.StringIO()
    p = ProgressReporter(total_steps=5, console=Console(file=out, force_terminal=True, width=160))
    p.record({"step": 3, "loss": 2.5, "loss_scale": 65536.0, "world_size": 3})
    p.close()
    text = out.getvalue()
    assert "3/5" in text and "loss 2.5000" in text and "scale 65536" in text and "workers 3" in text


def test_a_validation_loss_from_an_earlier_step_says_which() -> None:
    out = io.StringIO()
    p = ProgressReporter(total_steps=30, console=Console(file=out, force_terminal=False, width=200),
                         log_every=10)
    p.record({"step": 10, "train_loss": 2.0})
    p.record({"step": 10, "val_loss": 3.0})
    p.record({"step": 20, "train_loss": 1.5})
    p.record({"step": 20, "final_val_loss": 2.9})  # the run's end: no second line for step 20
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step 10/30 | loss 2.0000 |")
    assert lines[1].startswith("eval step 10/30 | val 3.0000 |")
    assert lines[2].startswith("step 20/30 | loss 1.5000 | val 3.0000 (step 10) |")
