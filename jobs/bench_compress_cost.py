"""What gradient compression costs to compute on one device, and the link speed it needs to pay.

Compression wins only where the bytes it saves would take longer to send than compressing
takes. This times the engine's own compressors (`TopK`, `PowerSGD`) over one step's gradient
buckets of a GPT (`GPT_SIZES`, the 350M of ../shared/anchors by default, buckets of the engine's default
50M elements) in a one-rank process group, so it runs on a single GPU: everything but the wire.
It prints, per method, the compute time per step, the bytes a rank sends, and the break-even
bandwidth: below it compression saves time, above it (NVLink) the dense reduction is faster.

    python jobs/bench_compress_cost.py --device cuda [--model 350m] [--out cost.json]

Break-even = (dense bytes - compressed bytes) / compression seconds, for the bytes one rank
puts into the collective. (A ring all-reduce moves 2(N-1)/N of its buffer per rank, an
all_gather (N-1) payloads: on many ranks top-k's all_gather loses more, so this is the
two-rank case.) Only exposed communication counts against the step: where backward hides the
dense reduction, compression has nothing to win at any link speed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_ray.engine.compression.topk import TopK  # noqa: E402
from hybrid_ray.engine.compression.powersgd import PowerSGD  # noqa: E402
from hybrid_ray.models import GPT  # noqa: E402
from hybrid_ray.models.gpt import GPT_SIZES  # noqa: E402


def gradient_buckets(model: torch.nn.Module, bucket_numel: int, device: torch.device, dtype: torch.dtype
                     ) -> List[Tuple[torch.Tensor, List[Tuple[int, torch.Size]]]]:
    """Random gradients laid out as the engine's flat buckets: (bucket, [(offset, shape)])."""
    out, layout, size = [], [], 0
    params = list(model.parameters())
    for i, p in enumerate(params):
        layout.append((size, p.shape))
        size += p.numel()
        if size >= bucket_numel or i == len(params) - 1:
            out.append((torch.randn(size, device=device, dtype=dtype), layout))
            layout, size = [], 0
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_method(comp, buckets, device: torch.device, iters: int) -> Dict[str, float]:
    """Median seconds per step to compress and decompress every bucket; bytes sent per step."""
    times, sent = [], 0
    for it in range(iters + 2):  # two warm-up steps: PowerSGD builds its plans and Q's there
        sync(device)
        t0 = time.perf_counter()
        sent = 0
        for key, (grad, layout) in enumerate(buckets):
            nbytes, finish = comp.exchange((0, key), grad, 0, grad.numel(), None, layout)
            finish()
            sent += nbytes
        sync(device)
        comp.on_step(False, 1.0)
        if it >= 2:
            times.append(time.perf_counter() - t0)
    return {"compress_s": statistics.median(times), "bytes_sent": sent}


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(GPT_SIZES), default="350m")
    ap.add_argument("--bucket-numel", type=int, default=50_000_000)
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dense_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = GPT(GPT_SIZES[args.model])
    buckets = gradient_buckets(model, args.bucket_numel, device, dense_dtype)
    numel = sum(b.numel() for b, _ in buckets)
    dense_bytes = numel * dense_dtype.itemsize
    init = tempfile.mkdtemp()  # the file store removes its file when the group ends
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init}/pg",
                            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        methods = {f"topk {args.topk_ratio}": TopK(args.topk_ratio),
                   f"powersgd rank {args.rank}": PowerSGD(args.rank)}
        results = {name: time_method(comp, buckets, device, args.iters) for name, comp in methods.items()}
    finally:
        dist.destroy_process_group()
        shutil.rmtree(init, ignore_errors=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{numel:,} parameters in {len(buckets)} buckets, {name}, torch {torch.__version__}; "
          f"dense reduction {dense_bytes / 1e6:.2f} MB per step ({dense_dtype})")
    print("| method | compute ms/step | MB sent/step | break-even link GB/s |")
    print("|---|---|---|---|")
    for r in results.values():
        r["break_even_GBps"] = (dense_bytes - r["bytes_sent"]) / r["compress_s"] / 1e9
    for m, r in results.items():
        print(f"| {m} | {1e3 * r['compress_s']:.1f} | {r['bytes_sent'] / 1e6:.2f} | {r['break_even_GBps']:.2f} |")
    out = {"params": numel, "buckets": len(buckets), "device": name, "dense_bytes": dense_bytes,
           "methods": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
