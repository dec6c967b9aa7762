"""Asynchronous checkpoint save: hybrid_ray against torch.distributed.checkpoint, one invocation.

    python jobs/bench_checkpoint.py --dir /path/on/the/disk       # GPU: GPT 1.3B, bf16, ZeRO-2, AdamW
    python jobs/bench_checkpoint.py --model small --cpu          # CPU smoke run, seconds

One process, one rank. The engine trains one step (so AdamW has its moments), then each repeat
saves the same state twice into the same directory: with `engine.save_checkpoint(...,
async_save=True)` and with `torch.distributed.checkpoint.async_save` given the equivalent state
dict: {"model": each parameter's fp32 master under its module name, "optimizer": the engine's
optimizer state_dict (AdamW's moments and step)}, i.e. the same bytes our checkpoint holds.

blocking: time until the call returns, when training could go on (the copy to host memory);
total: until the checkpoint is complete on disk (ours: committed, manifest and `latest` written).
Both flush files to disk (our `checkpoint.fsync`, DCP's `sync_files`), both reuse pinned host
buffers between repeats (DCP: `cache_staged_state_dict`), both write with `--threads` threads.
The first repeat includes allocating (and pinning) the host buffers; later ones show the steady
state. Each checkpoint is deleted after it is measured (`--keep` keeps them). Ratio: DCP / ours.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_ray.engine import Engine  # noqa: E402
from hybrid_ray.engine import Topology  # noqa: E402
from hybrid_ray.models import GPT, GPT_SIZES  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(GPT_SIZES), default="1.3b", help="GPT size (default 1.3b)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (small models; no pinned memory)")
    p.add_argument("--dir", default="/tmp/hybrid_ray_bench_checkpoint",
                   help="where both write (same disk); needs 2 x the state size free at a time")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind, alternating (default 3)")
    p.add_argument("--threads", type=int, default=4, help="writer threads for both (default 4)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    return p.parse_args()


def build(model: str, device: torch.device, threads: int) -> Engine:
    """The engine at ZeRO stage 2, bf16, AdamW, after one training step."""
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "checkpoint": {"fsync": True, "write_threads": threads}}
    gpt = GPT(GPT_SIZES[model])
    engine = Engine(gpt, cfg, topology=Topology(0, 1, device))
    seq, vocab = GPT_SIZES[model].seq_len, GPT_SIZES[model].vocab_size
    x = torch.randint(0, vocab, (1, seq + 1), device=device)
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    return engine


def dcp_state(engine: Engine) -> Dict[str, object]:
    """The same bytes as our checkpoint: fp32 masters by parameter name, the optimizer state."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    model = {}
    for space, master in zip(engine.spaces, engine.zero.masters):
        for p, off in space.param_offsets():
            shape = space.shapes[id(p)]
            model[names[id(p)]] = master.detach()[off:off + shape.numel()].view(shape)
    return {"model": model, "optimizer": engine.optimizer.state_dict()}


def nbytes(state: Dict[str, object]) -> int:
    total = 0
    for value in state.values():
        if torch.is_tensor(value):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += nbytes(value)
    return total


def timed(start: Callable[[], object], finish: Callable[[object], None],
          sync: Callable[[], None]) -> Tuple[float, float]:
    """(blocking, total) seconds: until start() returns, until finish(its result) returns."""
    sync()
    t0 = time.perf_counter()
    handle = start()
    blocking = time.perf_counter() - t0
    finish(handle)
    return blocking, time.perf_counter() - t0


def main() -> int:
    args = parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no GPU visible: pass --cpu (with --model small) to run on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(device)
    import torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
    from torch.distributed.checkpoint import FileSystemWriter

    engine = build(args.model, device, args.threads)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    state = dcp_state(engine)
    params = sum(p.numel() for p in engine.module.parameters())
    print(f"GPT {args.model}: {params / 1e6:,.1f} M parameters, bf16, ZeRO-2, AdamW, 1 rank on {device}; "
          f"state {nbytes(state) / 1e9:.2f} GB (fp32 masters + 2 moments); dir {root}; "
          f"torch {torch.__version__}", flush=True)
    # One writer across repeats: DCP's cached (pinned) staging buffers live in it.
    writer = FileSystemWriter(str(root / "dcp-0"), sync_files=True, thread_count=args.threads,
                              cache_staged_state_dict=device.type == "cuda")
    rows: List[Tuple[int, str, float, float]] = []
    for r in range(args.repeats):
        ours_dir, dcp_dir = root / f"ours-{r}", root / f"dcp-{r}"
        b, t = timed(lambda: engine.save_checkpoint(str(ours_dir), tag="bench", async_save=True),
                     lambda _: engine.wait_checkpoint(), sync)
        rows.append((r, "hybrid_ray async", b, t))
        b, t = timed(lambda: dcp.async_save(state, checkpoint_id=str(dcp_dir), storage_writer=writer),
                     lambda fut: fut.result(), sync)
        rows.append((r, "torch DCP async_save", b, t))
        for line in rows[-2:]:
            print(f"repeat {line[0]}: {line[1]:<22} blocking {line[2]:8.3f} s   "
                  f"total {line[3]:8.3f} s", flush=True)
        if not args.keep:
            shutil.rmtree(ours_dir, ignore_errors=True)
            shutil.rmtree(dcp_dir, ignore_errors=True)
    engine.close()
    ours = [row for row in rows if row[1].startswith("hybrid")][-1]
    theirs = [row for row in rows if row[1].startswith("torch")][-1]
    print(f"last repeat: blocking ours {ours[2]:.3f} s vs DCP {theirs[2]:.3f} s "
          f"(DCP/ours {theirs[2] / ours[2]:.2f}x); total ours {ours[3]:.3f} s vs DCP {theirs[3]:.3f} s "
          f"(DCP/ours {theirs[3] / ours[3]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
