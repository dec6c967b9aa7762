"""The host optimizer step of ZeRO-Offload: torch's fused CPU AdamW (what the engine runs) against
DeepSpeed's CPUAdam (its AVX kernel, built at first use), on one flat fp32 tensor.

    python jobs/bench_cpu_adam.py --numel 1.3e9 --threads 16

Memory-bound: each step reads parameter, gradient and both moments and writes three of them
(28 bytes per element), so the table also prints the effective bandwidth. Rows are appended to
benchmarks/runs/DATE-cpu-adam.jsonl (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def timed(step, steps: int) -> float:
    step()  # first step allocates the state (and builds DeepSpeed's kernel)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def run(impl: str, numel: int, steps: int) -> float:
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    if impl == "torch-fused":
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    elif impl == "torch-foreach":
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, foreach=True)
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.1, adamw_mode=True)
    dt = timed(opt.step, steps)
    del opt, p
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=1e8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--impls", default="torch-fused,deepspeed,torch-foreach")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    numel = int(a.numel)
    out = a.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "runs", f"{time.strftime('%Y-%m-%d')}-cpu-adam.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for impl in a.impls.split(","):
        try:
            dt = run(impl, numel, a.steps)
        except Exception as e:  # DeepSpeed missing, or its kernel failed to build
            print(f"# {impl}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row = dict(impl=impl, numel=numel, threads=a.threads, step_s=round(dt, 4),
                   gb_s=round(28 * numel / dt / 1e9, 1), host=platform.node(), cpus=os.cpu_count())
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    base = next((r for r in rows if r["impl"] == "deepspeed"), rows[0] if rows else None)
    for r in rows:
        print(f"{r['impl']:<16}{r['step_s'] * 1e3:>10.1f} ms{r['gb_s']:>8.1f} GB/s"
              f"{base['step_s'] / r['step_s']:>8.2f}x {base['impl']}")


if __name__ == "__main__":
    main()
