"""The Ray layer on GPUs: two workers each owning one GPU form an NCCL group; a worker that
exits is replaced and the run ends as an uninterrupted one. Skipped without two GPUs."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_two_gpu_workers_nccl_survive_a_lost_worker(tmp_path) -> None:
    import ray
    from ray import cloudpickle  # the pickler Ray uses for functions

    from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
    from tests.cluster import trainfns

    os.environ["RAY_AUTH_MODE"] = "disabled"
    cloudpickle.register_pickle_by_value(trainfns)
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        def fit(name, fault=None):
            fn = lambda ctx: trainfns.train_mlp(ctx, steps=12, fault=fault)  # noqa: E731
            return ElasticTrainer(fn, ScalingConfig(min_workers=2, max_workers=2, use_gpu=True),
                                  FailureConfig(max_failures=1, collective_timeout_s=30.0),
                                  storage_path=str(tmp_path), run_name=name).fit()
        plain = fit("plain")
        lost = fit("lost", {"generation": 0, "rank": 1, "step": 5, "kind": "exit"})
    finally:
        ray.shutdown()
    assert plain.world_sizes == [2] and lost.world_sizes == [2, 2], lost.events
    for k, v in plain.value.items():
        assert torch.allclose(v, lost.value[k], rtol=1e-5, atol=1e-6), k
