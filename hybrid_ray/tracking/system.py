"""System metrics (CPU, memory, disk, network, GPU) from MLflow's own collectors, sent through
the tracker's queue.

MLflow's switch for this (`mlflow.start_run(log_system_metrics=True)` or
`mlflow.enable_system_metrics_logging()`) belongs to the fluent API: it starts a
SystemMetricsMonitor for the fluent active run only, and does nothing for MlflowClient-style
logging to a run id. That monitor also asks the server for the run's status after every sample
and stops for good at the first failed request. So we run MLflow's collector classes
(mlflow.system_metrics.metrics: psutil for CPU/memory/disk/network, pynvml or pyrsmi for GPUs
where installed) on our own thread and publish their averages like any other metric: buffered
through outages, `system/` prefix, steps counted on from a resumed run's last one, and MLflow's
MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL / _SAMPLES_BEFORE_LOGGING / _NODE_ID settings honoured.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

from mlflow.environment_variables import (MLFLOW_SYSTEM_METRICS_NODE_ID,
                                          MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING,
                                          MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL)

from .run import SYSTEM_PREFIX

log = logging.getLogger("hybrid_ray.tracking")


def collectors() -> List[object]:
    """MLflow's collectors that work on this machine."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
    out: List[object] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    for module, name in (("gpu_monitor", "GPUMonitor"), ("rocm_monitor", "ROCMMonitor")):
        try:  # each raises when its library (pynvml, pyrsmi) or a device is missing
            mod = importlib.import_module(f"mlflow.system_metrics.metrics.{module}")
            out.append(getattr(mod, name)())
            break
        except Exception:  # noqa: BLE001 - no GPU monitor is a normal outcome
            continue
    return out


def sampling_interval_s(default: float = 10.0) -> float:
    """MLflow's sampling interval setting (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL), read on the
    driver and handed to the workers: their processes do not see the driver's environment."""
    return float(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or default)


class SystemMonitor:
    """Samples every `interval_s`; publishes the average of `samples` samples as one step."""

    def __init__(self, publish: Callable[[Dict[str, float], int, int], None],
                 interval_s: float = 10.0, samples: int = 1, node_id: Optional[str] = None):
        self.publish = publish
        self.interval_s = MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or interval_s
        self.samples = MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING.get() or samples
        node = MLFLOW_SYSTEM_METRICS_NODE_ID.get() or node_id
        self.prefix = SYSTEM_PREFIX + (f"{node}/" if node else "")
        self.monitors = collectors()
        self._stop = threading.Event()
        self._index = 0
        self._thread = threading.Thread(target=self._loop, name="hybrid_ray-system-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for _ in range(self.samples):
                self._collect()
                if self._stop.wait(self.interval_s):
                    break
            self._publish()

    def _collect(self) -> None:
        for monitor in self.monitors:
            try:
                monitor.collect_metrics()
            except Exception as exc:  # noqa: BLE001 - a failing probe must not end the thread
                log.debug("system metrics: %s failed: %s", type(monitor).__name__, exc)

    def _publish(self) -> None:
        values: Dict[str, float] = {}
        for monitor in self.monitors:
            if monitor.metrics:
                values.update(monitor.aggregate_metrics())
            monitor.clear_metrics()
        if values:
            self.publish({self.prefix + k: float(v) for k, v in values.items()}, self._index,
                         int(time.time() * 1000))
            self._index += 1

    def stop(self) -> None:
        """Stop sampling; the samples taken so far are published first."""
        self._stop.set()
        self._thread.join(timeout=max(5.0, self.interval_s))
