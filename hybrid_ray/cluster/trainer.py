"""ElasticTrainer: the user's entry point to training on a Ray cluster.

    trainer = ElasticTrainer(train_fn, scaling=ScalingConfig(min_workers=1, max_workers=4),
                             failure=FailureConfig(max_failures=3), storage_path="/shared/runs",
                             run_name="gpt-350m")
    result = trainer.fit()

`train_fn(ctx)` runs on every worker of each generation of the group and must resume from the
newest checkpoint under ctx.storage_path/ctx.run_name (the LM job does). Connects to the Ray
cluster at `address` (or RAY_ADDRESS); with neither, starts a local one with ray.init().
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import ray

from hybrid_ray.config.cluster import FailureConfig, ScalingConfig
from hybrid_ray.config.paths import absolute

from .controller import Controller, Result
from .group import WorkerGroup
from .local import start_local
from .records import Record


class ElasticTrainer:
    def __init__(self, train_fn: Callable, scaling: Optional[ScalingConfig] = None,
                 failure: Optional[FailureConfig] = None, storage_path: str = "./runs",
                 run_name: str = "run", address: Optional[str] = None,
                 on_record: Optional[Callable[[Record], None]] = None,
                 on_event: Optional[Callable[[str], None]] = None,
                 node_metrics_interval_s: Optional[float] = None):
        """on_record: called on the driver with every record a worker sends (records.py: the
        Metrics of ctx.report, read like the reported dict; SystemSample; the job's own kinds);
        on_event: with every membership event as one line of text."""
        if not callable(train_fn):
            raise TypeError(f"train_fn must be callable as train_fn(ctx), got {type(train_fn).__name__}")
        self.train_fn = train_fn
        self.scaling = scaling or ScalingConfig()
        self.failure = failure or FailureConfig()
        # Workers may run on other nodes: hand them an absolute path (or a URI as given).
        self.storage_path = absolute(storage_path)
        self.run_name, self.address = run_name, address
        self.on_record, self.on_event = on_record, on_event
        # Seconds between system-metric samples on every node of the group (SystemSample
        # records to on_record); None: no sampling.
        self.node_metrics_interval_s = node_metrics_interval_s
        self.controller: Optional[Controller] = None

    def fit(self) -> Result:
        connect(self.address)
        self.controller = Controller(self.train_fn, self.scaling, self.failure, self.storage_path,
                                     self.run_name, WorkerGroup(self.scaling, self.run_name),
                                     self.on_record, self.on_event, self.node_metrics_interval_s)
        return self.controller.run()


def connect(address: Optional[str]) -> None:
    """Join the cluster (address, RAY_ADDRESS) or start a local one; keep an existing session."""
    if ray.is_initialized():
        return
    # Ray 2.60 turns token authentication on once a token exists; a local session started here
    # has none, so say so explicitly unless the user chose.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not sys.stdout.isatty():  # the workers' lines come with colour codes otherwise: noise in a log
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:  # a cluster of this machine only, kept on loopback
        start_local(log_to_driver=True, include_dashboard=False)


def cluster_has_gpus() -> bool:
    """Whether the connected cluster has at least one GPU (for `use_gpu=None`: let it decide)."""
    return ray.cluster_resources().get("GPU", 0) >= 1
