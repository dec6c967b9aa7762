"""A user's 2-rank training script, launched by test_clean_exit.py as its own process per rank:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python exit_script.py MODE [DIR]

It builds engines with hybrid_ray.initialize, takes a few steps, then ends the way scripts do:
`dist.barrier(); dist.destroy_process_group()` and falls off the end with the engines still
alive in its globals; no destroy(). Mode "compiled" ends as DeepSpeed's torch_compile test does:
a compiled ZeRO-3 engine, and not even destroy_process_group(). MODE picks the features (see
MODES). Exit status 0 is the test.

One check is added to what a user writes: a last atexit hook (registered before hybrid_ray
makes its own, so it runs after it) fails the run with exit status 3 if gloo's or the TCPStore's
threads are still running then, i.e. if anything still held the process group when the
interpreter began its teardown. That is the state in which the process used to abort at exit.
"""
import atexit
import faulthandler
import os
import sys

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def native_threads():
    """Names of this process's OS threads (Linux; empty elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return names


def check_group_gone():
    alive = [n for n in native_threads() if n in GLOO_THREADS]
    if alive:
        print(f"rank {os.environ['RANK']}: process group still alive at exit: {alive}",
              file=sys.stderr, flush=True)
        os._exit(3)


atexit.register(check_group_gone)
faulthandler.enable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hybrid_ray  # noqa: E402

MODE = sys.argv[1]
OUT = sys.argv[2] if len(sys.argv) > 2 else None
torch.set_num_threads(1)


class Net(nn.Module):
    """Blocks in a ModuleList: ZeRO-3 units."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def config(stage, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                 "stage3_param_persistence_threshold": 10}}
    cfg.update(extra)
    return cfg


TOPK = {"type": "topk", "topk_ratio": 0.1}
OFFLOAD = {"offload_optimizer": {"device": "cpu", "delayed_param_update": True}}
MODES = {
    "zero2": [config(2)],
    "zero3": [config(3)],
    "topk": [config(2, gradient_compression=TOPK)],
    "multi": [config(0), config(1, gradient_compression=TOPK), config(3),
              config(2, gradient_compression={"type": "powersgd", "rank": 2})],
    "offload": [config(2, zero_optimization={"stage": 2, **OFFLOAD}, checkpoint={"async_save": True})],
    "compiled": [config(3, bf16={"enabled": True})],  # engine.compile(), as DeepSpeed's test_compile.py
}

if MODE in ("zero3", "multi"):  # the others leave it to the engine, from the environment
    dist.init_process_group("gloo")
torch.manual_seed(0)
engines = [hybrid_ray.initialize(Net(), config=cfg)[0] for cfg in MODES[MODE]]
if MODE == "compiled":
    engines[0].compile()
rank = dist.get_rank()
g = torch.Generator().manual_seed(rank)
for engine in engines:
    for step in range(6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    if OUT is not None and engine.config.checkpoint.async_save:
        engine.save_checkpoint(OUT)  # still being written when the script ends
print(f"rank {rank}: {MODE} loss {loss.item():.4f}", flush=True)
if MODE != "compiled":  # DeepSpeed's scripts end without these: the group is hybrid_ray's to end
    dist.barrier()
    dist.destroy_process_group()
