"""A stand-in buddy for replay mode at one rank (`jobs/benchmark.py --replicas 1 --replay` with
one process): what replay costs a rank, timed where there is no second rank to replay to.

Each step, before the update, the rank's reduced gradient shard goes to host memory (as the
ring's `start_gradients` sends it) and a background thread applies the same optimizer step to a
host copy of the shard with the buddy's optimizer (replay.Stepper, the CPU kernel); the next
step's exchange first waits for that application, as the ring does. What it leaves out: the
transfer between hosts (gloo) and the commit's all-reduce. At N ranks a buddy steps 1/N of the
parameters: this loop is the N = 1 worst case of the buddy's step, and the exact per-rank cost
of the gradient's device-to-host copy at ZeRO's 1/N.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Dict

from hybrid_ray.engine.replicas import replay, snapshot


def loopback_buddy(engine: Any, on_device: bool = False) -> Dict[str, Any]:
    """Wrap `engine`'s update with a buddy in this process; the stand-in's state (its pool).
    on_device (replay_on device): the copy lies where the masters lie, the gradient stays there
    (the ring sends it over NCCL), and the copy steps with the owner's kernel on its own stream."""
    apply = engine.zero.apply
    box: Dict[str, Any] = {"pool": cf.ThreadPoolExecutor(1, thread_name_prefix="loopback-buddy")}

    def mirrored(update: Any) -> None:
        fut = box.pop("fut", None)
        if fut is not None:
            fut.result()  # the buddy applied the last step before this one is sent
        stepper = box.get("stepper")
        if update is not None and stepper is not None:
            # as the ring sends them: over NCCL on the device, or to the host for gloo
            grads = [g.detach().clone() if on_device else g.detach().to("cpu", copy=True) for g in update.grads]
            pending = replay.Pending(engine.global_steps, grads, update.coef,
                                     replay.hyperparameters(update.optimizer), b"",
                                     tuple(update.frozen) if update.frozen is not None else None)
            pending.mark_arrived()
            box["fut"] = box["pool"].submit(stepper.apply, pending)
        apply(update)
        if stepper is None and engine.optimizer.state:  # the base: once the optimizer has state
            ts = engine.train_state()
            copy = [{k: (t.detach().clone() if on_device else t.detach().cpu().clone()) for k, t in ts_.items()}
                    for ts_ in snapshot.shard_tensors(ts)]
            box["stepper"] = replay.Stepper(replay.optimizer_spec(ts), copy, owners_kernel=on_device)

    engine.zero.apply = mirrored
    return box
