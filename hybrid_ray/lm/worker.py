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
from hybrid_ray.lm.setup import RunContext, warm_model


@dataclass(frozen=True)
class LMTrainFn:
    """Picklable training function for the workers: the (validated) raw job travels with it."""

    raw: Dict[str, Any]

    def warm(self) -> None:
        """A spare's preparation while it waits (the imports came with unpickling this, the
        device's start with the worker's warm-up): the job's model, built and kept."""
        warm_model(load_job(self.raw))

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
