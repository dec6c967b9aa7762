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

    python jobs/compression_quality.py --config jobs/configs/quality.json \
        --variant dense --variant topk:0.01:200 --variant topk:0.05:100 [--steps 3000] [--seeds 3]

A variant is `dense`, `topk:RATIO:WARMUP_STEPS[:VALUES[:INDICES]]` (VALUES fp32, bf16 or int8;
INDICES int32 or block16: gradient_compression.topk_values / topk_indices), 1-bit Adam
`onebit:WARMUP` (momentum form), `onebit-grad:WARMUP` (gradient form) or
`onebit-pre:WARMUP` (momentum form, sent divided by the frozen sqrt(variance)), options `bBLOCK`
(a scale per BLOCK elements instead of one per chunk) and `rREFRESH` (every REFRESH steps one dense
AdamW step that updates the variance, counted as dense bytes) and `c0` (without the engine's
gradient_compression.update_bound: 1-bit Adam's update as published), `frozen:WARMUP[:rREFRESH]`
(AdamW whose variance freezes after WARMUP steps, gradients exact: what the freeze alone costs), or
`dense:lrSCALE` (dense at SCALE times the config's learning rate: whether dense's own lr is its best). Prints one row per variant (mean over seeds,
and the seeds' range) with the gap to dense and the byte ratio after the warm-up and over the
whole run, and appends the rows as JSON to benchmarks/runs/<date>-quality-<steps>x<ranks>.jsonl
(or --out) with the corpus they were measured on (sources, bytes, tokens, sha256).

No window of training text is seen twice in a run: each seed draws a permutation of the
training windows and walks it. A run that needs more windows than the corpus has is refused
(--allow-repeat lets it take a new permutation per pass, and the rows say how many passes).
jobs/configs/quality.json reads the standard library and the installed packages (120 MB, enough
for 3000 steps at 4 ranks in under one pass).

The bar (issue 21): a variant counts when even its worst seed is within 3% of dense's best seed
(`gap_hi` <= 3%, so the margin holds beyond the seeds' spread), with at least 30x fewer bytes
after its warm-up and 10x over the whole run (`meets_bar`).
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_ray.data import ensure_prepared  # noqa: E402
from hybrid_ray.engine.compression.codec import VALUE_BYTES, PairCodec  # noqa: E402
from hybrid_ray.engine.compression.onebit import SignAverage, payload_bytes  # noqa: E402
from hybrid_ray.engine.compression.topk import TopK  # noqa: E402
from hybrid_ray.engine.zero.frozen import step_frozen_variance  # noqa: E402
from hybrid_ray.lm.job import Job, load_job  # noqa: E402
from hybrid_ray.lm.simulated import (Windows, bucket_grads, load_windows, rank_batches, set_grads,  # noqa: E402,F401 (Windows: tests)
                                     start, val_loss)


@dataclass(frozen=True)
class Variant:
    name: str
    ratio: Optional[float] = None  # top-k density; None: dense or onebit
    warmup: int = 0
    codec: PairCodec = PairCodec()
    onebit: str = ""  # 1-bit Adam after `warmup` AdamW steps: "momentum" (the paper's) or "grad" (ZeRO's);
    # "none": the variance frozen the same way, gradients averaged exactly (what the freeze alone costs)
    block: int = 0  # 1-bit: one scale per `block` elements (0: one per owner's chunk, as the engine)
    refresh: int = 0  # 1-bit: every `refresh` steps after the warm-up one dense AdamW step updates the variance
    bound: bool = True  # 1-bit: the engine's update_bound (the frozen variance read as at least m^2)
    lr: float = 1.0  # dense: the job's learning rate times this (is the dense baseline's lr the best one?)


ONEBIT = {"onebit": "momentum", "onebit-grad": "grad", "onebit-pre": "preconditioned", "frozen": "none"}


def parse_variant(text: str) -> Variant:
    """`dense` or `topk:RATIO:WARMUP[:VALUES[:INDICES]]`; a one-line error otherwise."""
    if text == "dense":
        return Variant("dense")
    if text.startswith("dense:lr"):
        try:
            scale = float(text[len("dense:lr"):])
        except ValueError:
            scale = 0.0
        if scale > 0:
            return Variant(text, lr=scale)
    parts = text.split(":")
    if parts[0] in ONEBIT and len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) > 0:
        opts = {p[:1]: p[1:] for p in parts[2:]}
        if len(opts) == len(parts) - 2 and set(opts) <= {"b", "r", "c"} and all(v.isdigit() for v in opts.values()) \
                and int(opts.get("b", 32)) >= 32 and int(opts.get("r", 1)) >= 1 and opts.get("c", "1") in "01":
            return Variant(text, warmup=int(parts[1]), onebit=ONEBIT[parts[0]], block=int(opts.get("b", 0)),
                           refresh=int(opts.get("r", 0)), bound=opts.get("c", "1") == "1")
    try:
        if parts[0] != "topk" or not 3 <= len(parts) <= 5:
            raise ValueError
        ratio, warmup = float(parts[1]), int(parts[2])
        codec = PairCodec(*parts[3:])
        if not 0 < ratio <= 1 or warmup < 0 or codec.values not in VALUE_BYTES \
                or codec.indices not in ("int32", "block16"):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--variant {text!r}: expected 'dense', 'topk:RATIO:WARMUP[:VALUES[:INDICES]]' "
                         "(0 < RATIO <= 1, WARMUP >= 0, VALUES fp32|bf16|int8, INDICES int32|block16) "
                         "'onebit[-grad|-pre]:WARMUP[:bBLOCK][:rREFRESH][:c0]', 'frozen:WARMUP[:rREFRESH][:c0]' or "
                         "'dense:lrSCALE' (SCALE > 0) "
                         "(WARMUP, REFRESH > 0, BLOCK >= 32), e.g. topk:0.01:200, "
                         "topk:0.05:100:int8:block16, onebit:200 or onebit:200:b256:r100")
    return Variant(text, ratio, warmup, codec)


def run(job: Job, variant: Variant, steps: int, seed: int, ranks: int, data, allow_repeat: bool = False) -> dict:
    """Train one variant; val loss (nats/token) and bytes sent per rank."""
    if variant.onebit:
        return run_onebit(job, variant, steps, seed, ranks, data, allow_repeat)
    train, val, _ = data
    e = job.engine
    model, opt, sched, buckets, windows = start(_scaled(job, variant.lr), steps, seed, ranks, data, allow_repeat)
    comps = [TopK(variant.ratio, variant.warmup, codec=variant.codec) for _ in range(ranks)] if variant.ratio else None
    sent = dense_bytes = sent_after = dense_after = 0
    for step in range(steps):
        sums = [torch.zeros(sum(p.numel() for p in b), device=train.device) for b in buckets]
        for r, batch in enumerate(rank_batches(job, train, windows, ranks)):
            for key, (grad, total) in enumerate(zip(bucket_grads(model, buckets, batch), sums)):
                if comps is None:
                    total.add_(grad)
                    nbytes = grad.numel() * 4
                else:
                    i, v, payload = comps[r].select((0, key), grad)
                    total.index_add_(0, i.long(), v)
                    nbytes = payload.numel()
                sent, dense_bytes = sent + nbytes, dense_bytes + grad.numel() * 4
                if comps is None or step >= variant.warmup:
                    sent_after, dense_after = sent_after + nbytes, dense_after + grad.numel() * 4
        set_grads(buckets, [t / ranks for t in sums])
        if e.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), e.gradient_clipping)
        opt.step()
        if sched is not None:
            sched.step()
        for c in comps or ():
            c.on_step(False, 1.0)
    return {"val_loss": val_loss(model, val, job.train.eval_samples, e.train_micro_batch_size_per_gpu),
            "bytes_ratio_after_warmup": dense_after / sent_after if sent_after else None,
            "bytes_ratio_whole_run": dense_bytes / sent, "passes": windows.passes}


def _scaled(job: Job, lr: float) -> Job:
    """The job with its optimizer's learning rate times `lr` (the scheduler scales from it)."""
    if lr == 1.0:
        return job
    job = copy.deepcopy(job)
    job.engine.optimizer.params["lr"] *= lr
    return job


def run_onebit(job: Job, variant: Variant, steps: int, seed: int, ranks: int, data,
               allow_repeat: bool = False) -> dict:
    """1-bit Adam (onebit.py): the job's AdamW for `variant.warmup` steps, then its variance
    frozen and the update AdamW's (bias corrections included) with that variance.
    "momentum": each rank's momentum is averaged at one bit per element (the paper's form, the
    engine's `form: momentum`); a rank clips its own gradient first (the global norm would need
    the uncompressed sum). "grad": each rank's gradient is averaged at one bit per element (the
    engine's `form: gradient`), clipped by the averaged gradient's global norm as dense is, and
    fed to the shared momentum. Both send each owner its chunk with its own scale, as the engine
    does, and leave elements that saw no gradient in the warm-up alone (zero/frozen.py)."""
    train, val, _ = data
    e = job.engine
    model, opt, sched, buckets, windows = start(job, steps, seed, ranks, data, allow_repeat)
    beta1 = opt.param_groups[0]["betas"][0]
    avg = SignAverage(ranks, variant.block)
    momentum = variance = None
    sent = dense_bytes = 0
    for step in range(steps):
        grads = [bucket_grads(model, buckets, batch) for batch in rank_batches(job, train, windows, ranks)]
        dense = sum(g.numel() * 4 for g in grads[0]) * ranks
        dense_bytes += dense
        refresh = variant.refresh and step > variant.warmup and (step - variant.warmup) % variant.refresh == 0
        if step < variant.warmup or refresh:
            sent += dense  # the optimizer's state holds the frozen phase's momentum and step count
            set_grads(buckets, [torch.stack(gs).mean(0) for gs in zip(*grads)])
            if e.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), e.gradient_clipping)
            opt.step()
            momentum = None
        else:
            if momentum is None:  # freeze: the optimizer's moments, one flat tensor per bucket
                momentum, variance = ([torch.cat([opt.state[p][k].reshape(-1) for p in b]) for b in buckets]
                                      for k in ("exp_avg", "exp_avg_sq"))
            momentum = _onebit_momentum(variant.onebit, avg, momentum, grads, beta1, e.gradient_clipping, variance)
            # A rank sends 2(W-1)/W of the tensor at one bit (its chunks to their owners, and in
            # the momentum form the served chunk back), as a dense ring all-reduce sends 2(W-1)/W
            # of it at fp32: at two ranks, n/8 bytes against the n*4 the dense baseline counts.
            sent += dense if variant.onebit == "none" else \
                sum(payload_bytes(m.numel(), variant.block) for m in momentum) * ranks
            _frozen_step(opt, buckets, momentum, variant.bound)
        if sched is not None:
            sched.step()
    after = steps - variant.warmup
    return {"val_loss": val_loss(model, val, job.train.eval_samples, e.train_micro_batch_size_per_gpu),
            "bytes_ratio_after_warmup": (dense_bytes / steps * after) / (sent - dense_bytes / steps * variant.warmup)
            if after > 0 else None,
            "bytes_ratio_whole_run": dense_bytes / sent, "passes": windows.passes}


def _onebit_momentum(form: str, avg: SignAverage, momentum: List[torch.Tensor], grads: List[List[torch.Tensor]],
                     beta1: float, clip: float, variance: List[torch.Tensor]) -> List[torch.Tensor]:
    """The next momentum, one flat tensor per bucket, from each rank's bucket gradients.
    "preconditioned": the momentum form with each element divided by its frozen sqrt(variance)
    before the exchange and multiplied back after, so that one bit's error is even across the
    update rather than across the momentum (elements that saw no gradient send 0)."""
    if form in ("momentum", "preconditioned"):
        grads = [_clipped(gs, clip) for gs in grads] if clip > 0 else grads
        out = []
        for key, (m, v) in enumerate(zip(momentum, variance)):
            sent = [beta1 * m + (1 - beta1) * g[key] for g in grads]
            if form == "momentum":
                out.append(avg.average(key, sent))
                continue
            d = v.sqrt()
            unseen = d == 0
            d.masked_fill_(unseen, 1.0)
            out.append(avg.average(key, [x.div(d).masked_fill_(unseen, 0.0) for x in sent]).mul_(d))
        return out
    per_key = [[g[key] for g in grads] for key in range(len(momentum))]
    mean = [torch.stack(gs).mean(0) if form == "none" else avg.reduce(key, gs) for key, gs in enumerate(per_key)]
    mean = _clipped(mean, clip) if clip > 0 else mean
    return [beta1 * m + (1 - beta1) * g for m, g in zip(momentum, mean)]


def _clipped(grads: List[torch.Tensor], clip: float) -> List[torch.Tensor]:
    norm = float(torch.stack([g.norm() for g in grads]).norm())
    return [g * (clip / (norm + 1e-6)) for g in grads] if norm > clip else grads


def _frozen_step(opt, buckets, momentum: List[torch.Tensor], bound: bool) -> None:
    """The engine's frozen-variance step (zero/frozen.py) with `momentum` as the new momentum: the
    optimizer's own state, bias corrections, decoupled decay per group and unseen-element mask."""
    set_grads(buckets, momentum)
    step_frozen_variance(opt, momentum_given=True, bound=bound)


def main(argv: Optional[List[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="jobs/configs/quality.json")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: the job's train.steps")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per variant: the first, then +1, ...")
    ap.add_argument("--seed", type=int, default=None, help="the first seed (default: the job's engine.seed)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--allow-repeat", action="store_true", help="let a run see its text more than once")
    ap.add_argument("--workers", type=int, default=1, help="runs at a time, each in its own process "
                    "(the model is tiny: one run leaves a GPU and most cores idle)")
    ap.add_argument("--out", default=None, help="append the rows as JSON lines here (default: "
                    "benchmarks/runs/<date>-quality-<steps>x<ranks>.jsonl)")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in (args.variant or ["dense", "topk:0.01:200"])]
    if not any(v.name == "dense" for v in variants):
        variants.insert(0, Variant("dense"))
    job = load_job(args.config)
    steps = args.steps or job.train.steps
    first = args.seed if args.seed is not None else (job.engine.seed or 0)
    seeds = [first + i for i in range(args.seeds)]
    tasks = [(job, v, steps, s, args.ranks, args.allow_repeat) for v in variants for s in seeds]
    results = _run_all(tasks, job, args.device, args.workers)
    corpus = corpus_record(job)
    raw = {v.name: [r for t, r in zip(tasks, results) if t[1] is v] for v in variants}
    rows = summarize(raw, steps, args.ranks, seeds, corpus, args)
    print_table(rows)
    out = Path(args.out or f"benchmarks/runs/{time.strftime('%Y-%m-%d')}-quality-{steps}x{args.ranks}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"# rows appended to {out}")
    return rows


_DATA = None  # a worker's windows, loaded once per process


def _load(job: Job, device: str) -> None:
    global _DATA
    _DATA = load_windows(job, torch.device(device))


def _timed_run(task) -> dict:
    job, variant, steps, seed, ranks, allow_repeat = task
    t0 = time.time()
    try:
        out = run(job, variant, steps, seed, ranks, _DATA, allow_repeat)
    except SystemExit as e:  # a pool worker would die on it and leave the pool waiting
        raise ValueError(str(e)) from None
    return {**out, "seconds": time.time() - t0}


def _run_all(tasks, job: Job, device: str, workers: int) -> List[dict]:
    """Each (job, variant, steps, seed, ranks, allow_repeat) run, in order; with several workers,
    in spawned processes (CUDA cannot be forked), each loading the windows once."""
    if workers <= 1:
        _load(job, device)
        return [_timed_run(t) for t in tasks]
    ensure_prepared(job.data.corpus, job.data.path, job.data.prepare, print)  # once, before the workers
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_load, initargs=(job, device)) as pool:
        try:
            return pool.map(_timed_run, tasks, chunksize=1)
        except ValueError as e:
            raise SystemExit(str(e)) from None


def corpus_record(job: Job) -> dict:
    """What the text was: sources, size and digest from the prepared dataset's meta."""
    meta = json.loads(Path(job.data.path, "meta.json").read_text())
    train = meta["splits"]["train"]
    return {"path": job.data.path, "sources": meta.get("sources") or [meta["source"]],
            "sha256": meta.get("corpus_sha256"), "python": meta.get("python"),
            "train_bytes": train["bytes"], "train_tokens": train["tokens"],
            "val_tokens": meta["splits"]["val"]["tokens"]}


def summarize(raw: dict, steps: int, ranks: int, seeds: List[int], corpus: dict, args) -> List[dict]:
    dense = [r["val_loss"] for r in raw["dense"]]
    base, best = statistics.mean(dense), min(dense)
    rows = []
    for name, runs in raw.items():
        losses = [r["val_loss"] for r in runs]
        after, whole = runs[0]["bytes_ratio_after_warmup"], runs[0]["bytes_ratio_whole_run"]
        gap_hi = max(losses) / best - 1
        rows.append({"variant": name, "ranks": ranks, "steps": steps, "seeds": seeds, "val_loss": losses,
                     "val_loss_mean": statistics.mean(losses), "val_loss_gap": statistics.mean(losses) / base - 1,
                     "gap_lo": min(losses) / max(dense) - 1, "gap_hi": gap_hi,
                     "bytes_ratio_after_warmup": after, "bytes_ratio_whole_run": whole,
                     "meets_bar": name != "dense" and gap_hi <= 0.03 and (after or 0) >= 30 and whole >= 10,
                     "passes": max(r["passes"] for r in runs), "corpus": corpus, "config": args.config,
                     "device": args.device, "seconds": round(sum(r["seconds"] for r in runs), 1)})
    return rows


def print_table(rows: List[dict]) -> None:
    r0 = rows[0]
    print(f"{r0['steps']} steps, {r0['ranks']} ranks, seeds {r0['seeds']}, {r0['config']}; corpus "
          f"{r0['corpus']['train_tokens']:,} training tokens, sha256 {str(r0['corpus']['sha256'])[:12]}, "
          f"{r0['passes']} pass(es)")
    print("| variant | val loss (mean) | vs dense | seeds' range vs dense | bytes ÷ after warm-up "
          "| bytes ÷ whole run | bar |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        after = r["bytes_ratio_after_warmup"]
        print(f"| {r['variant']} | {r['val_loss_mean']:.4f} | {100 * r['val_loss_gap']:+.1f}% | "
              f"{100 * r['gap_lo']:+.1f}% .. {100 * r['gap_hi']:+.1f}% | "
              f"{'-' if after is None else f'{after:.1f}x'} | {r['bytes_ratio_whole_run']:.1f}x | "
              f"{'meets' if r['meets_bar'] else '-'} |")


if __name__ == "__main__":
    main()
