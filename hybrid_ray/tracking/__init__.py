"""MLflow tracking for the driver: one run per job, buffered through tracking-server outages.

Imports MLflow; the engine never imports this package (workers send their numbers to the driver).
"""
from .sender import FlushReport
from .system import sampling_interval_s
from .tracker import DEFAULT_TRACKING_URI, RunTracker, classify

__all__ = ["RunTracker", "FlushReport", "classify", "DEFAULT_TRACKING_URI", "sampling_interval_s"]
