"""What top-k gradient compression costs in validation loss on an LM job, fast enough to sweep.

The main job takes ~6 minutes per 600-step run on the 2-core CPU, with Ray and two worker
processes; this study takes ~20 seconds per run on one GPU. It keeps what decides the quality:
the job's model, data, batch per rank, optimizer, scheduler, gradient clipping and seed, and
the engine's own `TopK` compressor (selection, error feedback, density warm-up), one instance
per simulated rank. The ranks run one after the other in one process: each computes its
micro-batch gradient, its compressor keeps the k largest entries per bucket, and the sum of the
kept pairs (divided by the number of ranks) is the gradient the optimizer sees, as the engine's
reduction produces it. What it leaves out: bf16 parameters (fp32 throughout) and Ray.
It reproduces the main job's gaps (600 steps, seeds 1234 and 1235): top-k 0.01 with a 200-step
warm-up ends 6.9% above dense here against 7.4% in the Ray job; top-k 0.05 with a 100-step
warm-up 3.2% against 3.9%.

    python jobs/compression_quality.py --config jobs/configs/small_cpu.json \
        --variant dense --variant topk:0.01:200 --variant topk:0.05:100 [--steps 1800] [--seeds 2]

A variant is `dense` or `topk:RATIO:WARMUP_STEPS`. Prints one row per variant (mean over seeds)
with the gap to dense and the byte ratio after the warm-up and over the whole run.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_ray.data import ensure_prepared, open_split  # noqa: E402
from hybrid_ray.engine.compression.topk import TopK  # noqa: E402
from hybrid_ray.engine.precision import is_norm  # noqa: E402
from hybrid_ray.engine.schedulers import build_scheduler  # noqa: E402
from hybrid_ray.lm.evaluate import evenly_spaced  # noqa: E402
from hybrid_ray.lm.job import Job, load_job  # noqa: E402
from hybrid_ray.lm.setup import build_model  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    ratio: Optional[float] = None  # None: dense
    warmup: int = 0


def parse_variant(text: str) -> Variant:
    """`dense` or `topk:RATIO:WARMUP`; a one-line error otherwise."""
    if text == "dense":
        return Variant("dense")
    parts = text.split(":")
    try:
        if parts[0] != "topk" or len(parts) != 3:
            raise ValueError
        ratio, warmup = float(parts[1]), int(parts[2])
        if not 0 < ratio <= 1 or warmup < 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--variant {text!r}: expected 'dense' or 'topk:RATIO:WARMUP' "
                         "(0 < RATIO <= 1, WARMUP >= 0), e.g. topk:0.01:200")
    return Variant(text, ratio, warmup)


def load_windows(job: Job, device: torch.device):
    """(train, val) windows of seq_len + 1 tokens as device tensors."""
    d = job.data
    meta = ensure_prepared(d.corpus, d.path, d.prepare, print)

    def stack(split: str) -> torch.Tensor:
        ds = open_split(d.path, meta, split, job.model.seq_len, d.cache_dir)
        return torch.stack([torch.cat([x, y[-1:]]) for x, y in (ds[i] for i in range(len(ds)))]).to(device)
    return stack("train"), stack("val"), meta["tokenizer"]["vocab_size"]


def buckets_of(model: torch.nn.Module) -> List[List[torch.nn.Parameter]]:
    """Parameters split as the engine's flat spaces split them under bf16: norms (kept fp32)
    and the rest. Each is one reduce bucket at the default bucket size on models this small."""
    norm_params = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}
    params = list(model.parameters())
    return [b for b in ([p for p in params if id(p) not in norm_params],
                        [p for p in params if id(p) in norm_params]) if b]


def run(job: Job, variant: Variant, steps: int, seed: int, ranks: int, data) -> dict:
    """Train one variant; val loss (nats/token) and bytes sent per rank."""
    train, val, vocab_size = data
    e = job.engine
    model = build_model(job, vocab_size, seed).to(train.device)
    opt = getattr(torch.optim, e.optimizer.type)(model.parameters(), **e.optimizer.params)
    sched = build_scheduler(_with_total(e.scheduler, steps), opt)
    buckets = buckets_of(model)
    comps = [TopK(variant.ratio, variant.warmup) for _ in range(ranks)] if variant.ratio else None
    micro = e.train_micro_batch_size_per_gpu
    gen = torch.Generator().manual_seed(seed)
    sent = dense_bytes = sent_after = dense_after = 0
    for step in range(steps):
        idx = torch.randint(0, train.shape[0], (micro * ranks,), generator=gen).to(train.device)
        sums = [torch.zeros(sum(p.numel() for p in b), device=train.device) for b in buckets]
        for r in range(ranks):
            batch = train[idx[r * micro:(r + 1) * micro]]
            model.zero_grad(set_to_none=True)
            model(batch[:, :-1], batch[:, 1:]).backward()
            for key, (bucket, total) in enumerate(zip(buckets, sums)):
                grad = torch.cat([p.grad.reshape(-1) for p in bucket])
                if comps is None:
                    total.add_(grad)
                    nbytes = grad.numel() * 4
                else:
                    i, v = comps[r].select((0, key), grad)
                    total.index_add_(0, i.long(), v)
                    nbytes = (i.numel() + v.numel()) * 4
                sent, dense_bytes = sent + nbytes, dense_bytes + grad.numel() * 4
                if comps is None or step >= variant.warmup:
                    sent_after, dense_after = sent_after + nbytes, dense_after + grad.numel() * 4
        for bucket, total in zip(buckets, sums):
            off = 0
            for p in bucket:
                p.grad = (total[off:off + p.numel()] / ranks).view_as(p)
                off += p.numel()
        if e.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), e.gradient_clipping)
        opt.step()
        if sched is not None:
            sched.step()
        for c in comps or ():
            c.on_step(False, 1.0)
    return {"val_loss": _val_loss(model, val, job.train.eval_samples, micro),
            "byte_ratio_after_warmup": dense_after / sent_after if sent_after else None,
            "byte_ratio_whole_run": dense_bytes / sent}


def _with_total(sched_cfg, steps: int):
    """The job's scheduler stretched over `steps` when it has a total (a longer study run)."""
    if sched_cfg is None or getattr(sched_cfg.params, "total_num_steps", None) is None:
        return sched_cfg
    return replace(sched_cfg, params=replace(sched_cfg.params, total_num_steps=steps))


@torch.no_grad()
def _val_loss(model, val: torch.Tensor, count: Optional[int], micro: int) -> float:
    """Mean loss over the same evenly spaced windows the job evaluates."""
    model.eval()
    chosen = torch.tensor(evenly_spaced(val.shape[0], count), device=val.device)
    total = 0.0
    for lo in range(0, chosen.numel(), micro):
        batch = val[chosen[lo:lo + micro]]
        total += model(batch[:, :-1], batch[:, 1:]).item() * batch.shape[0]
    return total / chosen.numel()


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="jobs/configs/small_cpu.json")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: the job's train.steps")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per variant: the job's, then +1, ...")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in (args.variant or ["dense", "topk:0.01:200"])]
    if not any(v.ratio is None for v in variants):
        variants.insert(0, Variant("dense"))
    job = load_job(args.config)
    steps = args.steps or job.train.steps
    data = load_windows(job, torch.device(args.device))
    seeds = [(job.engine.seed or 0) + i for i in range(args.seeds)]
    results = {}
    for v in variants:
        t0 = time.time()
        runs = [run(job, v, steps, s, args.ranks, data) for s in seeds]
        results[v.name] = {"val_loss": [r["val_loss"] for r in runs], **{k: runs[0][k] for k in runs[0] if k != "val_loss"},
                           "seconds": time.time() - t0}
    base = statistics.mean(results["dense"]["val_loss"])
    print(f"{steps} steps, {args.ranks} ranks, seeds {seeds}, {args.config}")
    print("| variant | val loss | vs dense | bytes ÷ after warm-up | bytes ÷ whole run |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        loss = statistics.mean(r["val_loss"])
        r["gap_vs_dense"] = loss / base - 1
        after = r["byte_ratio_after_warmup"]
        print(f"| {name} | {loss:.4f} | {100 * r['gap_vs_dense']:+.1f}% | "
              f"{after if after is None else f'{after:.1f}x'} | {r['byte_ratio_whole_run']:.1f}x |")
    out = {"steps": steps, "ranks": args.ranks, "seeds": seeds, "config": args.config, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
