"""What every Ray worker of the LM job runs: the job's training loop on the group it joined.

Kept apart from the driver (elastic.py), so that a worker unpickling it imports the training
code only, not MLflow and the driver's parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from hybrid_ray.cluster.context import StopTraining, WorkerContext
from hybrid_ray.lm.job import load_job
from hybrid_ray.lm.loop import train
from hybrid_ray.lm.setup import RunContext


@dataclass(frozen=True)
class LMTrainFn:
    """Picklable training function for the workers: the (validated) raw job travels with it."""

    raw: Dict[str, Any]

    def warm(self) -> None:
        """A spare's preparation while it waits (the imports came with unpickling this)."""
        if torch.cuda.is_available():
            torch.cuda.init()  # the device context: seconds a replacement need not pay

    def __call__(self, ctx: WorkerContext):
        # The worker set its thread count from its CPU resources: keep it (the loop would
        # otherwise split the machine's cores as if this were the only process on it).
        result = train(load_job(self.raw), RunContext(topology=ctx.topology, resume=True,
                                                      report=ctx.report, on_step=ctx.step_done,
                                                      stop=ctx.agree_to_stop,
                                                      directive=ctx.agree_on_directive,
                                                      flush=ctx.flush_reports, driver_prints=True,
                                                      threads=torch.get_num_threads()))
        if result.stopped:
            raise StopTraining()
        return result
