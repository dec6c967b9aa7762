"""The workers' side of the driver's compression choice (cluster/compression_follower.py) on one
engine without a process group: a setting the engine cannot run is refused without changing
anything and the next interval tells the driver why; the intervals of a compressor's dense
warm-up say so."""
from __future__ import annotations

import torch

import hybrid_ray
from hybrid_ray.cluster.compression_follower import DirectiveFollower
from hybrid_ray.cluster.compression_policy import candidates


def one_step(engine) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(engine.global_steps))
    engine.backward(engine(x).square().mean())
    engine.step()


def test_a_refused_setting_changes_nothing_and_the_interval_says_why_and_warm_ups_are_flagged():
    model = torch.nn.Linear(4, 2)
    engine, *_ = hybrid_ray.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config={"train_micro_batch_size_per_gpu": 2})
    onebit = candidates({"type": "auto"})[3]
    newest = {"id": 1, "setting": onebit, "reason": "test"}
    said = []
    follower = DirectiveFollower(engine, lambda: newest, said.append)
    one_step(engine)
    follower.after_step()
    follower.sync(engine.global_steps)  # 1-bit Adam needs Adam or AdamW: this engine steps SGD
    assert engine.gradient_compression["type"] == "none" and engine.reducer.compressor is None
    assert "onebit momentum refused here" in said[-1] and "dense goes on" in said[-1]
    iv = follower.interval(engine.global_steps, 1, 0.1)
    assert iv.setting_id == 1 and "Adam" in iv.refused and iv.to_json()["refused"] == iv.refused
    newest = {"id": 2, "setting": {"type": "topk", "topk_ratio": 0.5, "warmup_steps": 2}, "reason": "test"}
    follower.sync(engine.global_steps)
    assert engine.gradient_compression["type"] == "topk" and "now topk 0.5" in said[-1]
    flags = []
    for _ in range(4):
        one_step(engine)
        follower.after_step()
        iv = follower.interval(engine.global_steps, 1, 0.1)
        flags.append(iv.warming)
        assert iv.setting_id == 2 and iv.refused == ""
    assert flags == [True, True, False, False]  # two steps of warm-up, then its own speed
    engine.close()
