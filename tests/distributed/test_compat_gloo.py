"""DeepSpeed's getting-started loop at 2 gloo ranks with only the import changed:
init_distributed from the environment, hybrid_ray.comm, add_config_arguments + --deepspeed_config,
per-rank `ckpt_id = loss.item()` tags, resume, the loss falls."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from tests.distributed import spawn
from tests.distributed.spawn import free_port


def _ranks(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import hybrid_ray as deepspeed
    import hybrid_ray.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.init_distributed()  # already initialised: a no-op
    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (rank, world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    dist.barrier()
    assert t.item() == 3.0 and [o.item() for o in out] == [0.0, 1.0] and b.item() == 1.0
    try:
        _train(deepspeed, rank, root)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _train(deepspeed, rank: int, root: str) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", f"{root}/ds_config.json",
                              f"--local_rank={rank}"])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
    assert engine.dp_world_size == 2 and engine.zero_optimization_stage() == 2
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)

    def full_loss() -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(engine(x), y).item()

    first = full_loss()
    for step in range(1, 31):
        i = (step * 4) % 64
        loss = nn.functional.mse_loss(engine(x[i:i + 4]), y[i:i + 4])
        engine.backward(loss)
        engine.step()
        if step == 15:
            ckpt_id = loss.item()  # differs per rank: rank 0's tag wins
            engine.save_checkpoint(f"{root}/ckpt", ckpt_id, client_state={"step": step})
    assert full_loss() < 0.5 * first, (first, full_loss())
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    resumed, *_ = deepspeed.initialize(args=args, model=other)
    path, client = resumed.load_checkpoint(f"{root}/ckpt")
    assert client == {"step": 15} and resumed.global_steps == 15, (path, client)
    assert Path(path).name == open(f"{root}/ckpt/latest").read().strip()


def test_getting_started_loop_two_ranks(tmp_path: Path) -> None:
    (tmp_path / "ds_config.json").write_text(json.dumps({
        "train_batch_size": 8, "steps_per_print": 10, "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "adam_w_mode": False}},
        "zero_optimization": {"stage": 2, "cpu_offload": False}, "prescale_gradients": False,
        "wall_clock_breakdown": False}))
    mp.start_processes(_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method=spawn.START_METHOD, join=True)


def _pipeline_rank(rank: int, world: int, out: str) -> None:
    """train_batch at 2 ranks, ZeRO 2: each rank's half of every micro-batch."""
    import hybrid_ray as deepspeed
    from tests.unit.test_pipeline_module import batches, pipe

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}
    engine = deepspeed.initialize(model=pipe(), config=cfg)[0]
    data = [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]) for x, y in batches(4)]
    losses = [engine.train_batch(iter(data[i:i + 2])).item() for i in (0, 2)]
    state = {k: v.tolist() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "state": state}))
    engine.destroy()


def test_train_batch_at_two_ranks_equals_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    from tests.distributed import spawn
    from tests.unit.test_pipeline_module import CFG, batches, pipe
    import hybrid_ray as deepspeed

    spawn.run(_pipeline_rank, 2, str(tmp_path / "out.json"), timeout_s=60)
    got = json.loads((tmp_path / "out.json").read_text())
    engine = deepspeed.initialize(model=pipe(), config=CFG)[0]  # micro-batch 4 = both ranks' 2
    data = batches(4)
    losses = [engine.train_batch(iter(data[i:i + 2])).item() for i in (0, 2)]
    assert got["losses"] == pytest.approx(losses, rel=1e-6)  # the mean over ranks of their means
    for k, v in engine.module.state_dict().items():
        torch.testing.assert_close(torch.tensor(got["state"][k]), v, rtol=1e-5, atol=1e-6)
