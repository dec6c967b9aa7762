"""SIGTERM as an exception, so a stopped run can still record how it ended.

`ray job stop` sends the entrypoint SIGTERM and SIGKILLs it RAY_JOB_STOP_WAIT_TIME_S (3 s) later;
torchrun sends the other ranks SIGTERM when one fails. Python's default for SIGTERM ends the
process without unwinding, so the MLflow run would stay RUNNING; raised as `Terminated` it
unwinds to the code that closes the run KILLED.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


class Terminated(Exception):
    """This process was told to stop (SIGTERM)."""


def _raise(signum: int, frame: Any) -> None:
    raise Terminated("stopped by SIGTERM (the job was stopped, or another rank failed)")


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def ignore_terminate() -> None:
    """While the run is being closed: a second SIGTERM must not cut that short."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
