"""ZeRO stages 0-3 on two GPUs over NCCL equal fused AdamW on the whole batch (fp32).

Skipped without two GPUs (CI). On the GPU machine: `python3 -m pytest -q tests/gpu`.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from tests.distributed import spawn
from tests.gpu.test_offload_cuda import CFG, CUDA0, MICRO, STEPS, batch, max_rel_err, reference
from hybrid_ray.models import GPT

CASES = [(0, 1), (1, 2), (2, 2), (3, 2)]  # (stage, accumulation)


def config(stage: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200_000,
                                  "stage3_param_persistence_threshold": 1000}}


def _worker(rank: int, world: int, out: str) -> None:
    device = torch.device("cuda", rank)
    topo = Topology(rank, world, device, dist.group.WORLD)
    for stage, gas in CASES:
        torch.manual_seed(0)
        engine = Engine(GPT(CFG), config(stage, gas), topology=topo)
        for step in range(STEPS):
            for k in range(gas):
                engine.backward(engine(*batch(step, k, rank, device)))
                engine.step()
        state = engine.consolidated_state_dict(rank0_only=False)
        torch.save(state, Path(out) / f"s{stage}-r{rank}.pt")
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_zero_stages_match_fused_adamw(tmp_path: Path) -> None:
    spawn.run(_worker, 2, str(tmp_path), backend="nccl")
    for stage, gas in CASES:
        ref = {n: t.cpu() for n, t in reference(2, gas, False, CUDA0).items()}
        ranks = [torch.load(tmp_path / f"s{stage}-r{r}.pt") for r in range(2)]
        assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ref), stage
        err = max_rel_err(ranks[0], ref)
        assert err < 1e-5, (stage, gas, err)
