"""Buddy replicas on a CUDA device: the shard's copy to pinned host memory runs on a side stream
after the step's kernels, and the next update waits for it on the device, not the host.

One rank (no buddy to send to: this is the copy a GPU adds); skipped where no GPU is present."""
from __future__ import annotations

import pytest
import torch

from hybrid_ray.engine.replicas import KEEPER
from tests.gpu.test_cuda_engine import batch, engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("extra", [{}, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}],
                         ids=["device-masters", "offloaded-masters"])
def test_every_snapshot_equals_the_masters_of_its_step(extra) -> None:
    e = engine({"bf16": {"enabled": True}, "fault_tolerance": {"replicas": 1}, **extra})
    for step in range(4):
        e.backward(e(*batch(step)))
        e.step()
        e.replicas.wait()
        snap = KEEPER.get("own", e.global_steps)
        assert snap.tensors[0]["master"].is_pinned() or extra
        for live, copy in zip(e.zero.masters, snap.tensors):
            assert torch.equal(live.detach().cpu(), copy["master"])
            state = e.optimizer.state[live]
            assert torch.equal(state["exp_avg_sq"].cpu(), copy["exp_avg_sq"])
    e.destroy()
