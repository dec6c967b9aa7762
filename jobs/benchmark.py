"""Throughput of hybrid_ray against plain torch / DDP / DeepSpeed on the same GPT, one invocation.

    python jobs/benchmark.py --suite gpu1     # 1 GPU: torch, hybrid ZeRO-1/2, DeepSpeed ZeRO-2
    python jobs/benchmark.py --suite gpu2     # 2 GPUs: DDP, hybrid ZeRO-1/2, DeepSpeed ZeRO-2
    python jobs/benchmark.py --suite cpu      # 2 gloo processes on CPU, small model: DDP vs hybrid
    python jobs/benchmark.py --suite offload1 # 1 GPU, 1.3B: torch, hybrid and DeepSpeed ZeRO-2 + CPU offload
    python jobs/benchmark.py --suite offload2 # 2 GPUs, 1.3B: DeepSpeed and hybrid ZeRO-2 + CPU offload
    python jobs/benchmark.py --suite pipe-gpu1 # 1 GPU: the GPT as a one-stage PipelineModule
                                               # through train_batch against the plain engine
    python jobs/benchmark.py --suite compile-gpu1 # 1 GPU: blocks torch.compiled, torch against hybrid ZeRO-0/1/2
    (--profile DIR writes a torch.profiler kernel table and trace of 3 steps per implementation)

A suite launches each implementation with torchrun, one after the other, parses the RESULT line
each prints, and prints a table with tokens/s per GPU and the ratio to the baseline (plain torch
on one device, DDP on several). Absolute numbers drift between machines; the ratio is the claim.
Single run: torchrun --nproc_per_node=N jobs/benchmark.py --measure --impl hybrid --stage 2
(add --offload for optimizer offload to the CPU, --delayed-update for its delayed parameter update)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybrid_ray.models import GPT, GPT_SIZES, GPTConfig  # noqa: E402

LR, WD, CLIP = 3e-4, 0.1, 1.0
CPU_MODEL = GPTConfig(n_layer=4, n_head=4, d_model=256, vocab_size=8192, seq_len=256)

from bench_timing import sync as _sync, timed_steps  # noqa: E402  (jobs/ is on sys.path)
from benchmark_suites import BASELINE, BASELINE_SETTINGS, SUITES  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=list(SUITES))
    p.add_argument("--measure", action="store_true", help="one measurement (under torchrun)")
    p.add_argument("--impl", choices=["torch", "ddp", "fsdp2", "hybrid", "hybrid-pipe", "deepspeed"], default="hybrid")
    p.add_argument("--model", default=None, help=f"one of {list(GPT_SIZES)} (default 350m on GPU)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--mbs", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--bucket", type=float, default=5e7, help="hybrid reduce_bucket_size (elements)")
    p.add_argument("--offload", action="store_true", help="hybrid/deepspeed: optimizer offload to the CPU")
    p.add_argument("--offload-ratio", default="1.0",
                   help="hybrid with --offload: offload_optimizer.ratio, a fraction or 'auto' (partial offload)")
    p.add_argument("--overlap-gather", action="store_true",
                   help="hybrid stages 1-2: zero_optimization.overlap_param_gather")
    p.add_argument("--compile", action="store_true",
                   help="torch/ddp/hybrid: torch.compile each transformer block (inductor)")
    p.add_argument("--compile-head", action="store_true",
                   help="with --compile: also compile the final norm, head and loss together")
    p.add_argument("--replicas", type=int, default=0,
                   help="hybrid: buddy replicas, a copy every this many steps (0: none)")
    p.add_argument("--replay", action="store_true",
                   help="hybrid with --replicas 1: fault_tolerance.mode replay (the buddy steps its copy)")
    p.add_argument("--replay-on", choices=("host", "device"), default="host",
                   help="with --replay: fault_tolerance.replay_on (where the buddy keeps and steps its copy)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="hybrid: activation_checkpointing.enabled (each transformer block recomputed in backward)")
    p.add_argument("--delayed-update", action="store_true",
                   help="hybrid with --offload: delayed parameter update (one-step-stale parameters)")
    p.add_argument("--overlap-step", action="store_true",
                   help="hybrid with --offload: offload_optimizer.overlap_step (the CPU step bucket by bucket "
                        "during backward; clipped by the previous step's norm)")
    p.add_argument("--norm-activations", choices=["fp32", "half"], default=None,
                   help="hybrid: precision.norm_activations (default: the engine's)")
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1,
                   help="run the suite this many rounds, interleaved, and report each "
                        "implementation's median (for noisy shared machines)")
    p.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s per GPU for MFU")
    p.add_argument("--out", default=None, help="append result lines (JSON) to this file (a suite's "
                   "default: benchmarks/runs/DATE-SUITE.jsonl)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="with --measure: after timing, profile 3 steps on rank 0 and write a kernel table there")
    return p.parse_args()


# ---- one measurement -------------------------------------------------------------------
def make_step(a: argparse.Namespace, model: nn.Module, device: torch.device) -> Callable:
    """A closure doing one optimizer step of the chosen implementation."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.impl in ("hybrid", "hybrid-pipe"):
        return _hybrid_step(a, model)
    if a.impl == "deepspeed":
        return _deepspeed_step(a, model)
    if a.impl == "fsdp2":
        return _fsdp2_step(model, device, dt)
    if a.impl == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **fused)
    scaler = torch.amp.GradScaler(device.type) if a.dtype == "fp16" else None
    return _torch_step(model, opt, device.type, dt, dt != torch.float32, scaler)


def _torch_step(model: nn.Module, opt: torch.optim.Optimizer, device_type: str, dt: torch.dtype,
                use_autocast: bool, scaler: Optional[torch.amp.GradScaler]) -> Callable:
    """One step of a plain torch loop (torch, DDP, FSDP2): autocast, clip, step, zero_grad."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dt, enabled=use_autocast):
            loss = model(x, y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _hybrid_step(a: argparse.Namespace, model: nn.Module) -> Callable:
    import hybrid_ray
    cfg = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": a.stage, "reduce_bucket_size": int(a.bucket),
                                 "overlap_param_gather": a.overlap_gather}}
    if a.activation_checkpointing:
        cfg["activation_checkpointing"] = {"enabled": True}
    if a.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu", "pin_memory": True, "delayed_param_update": a.delayed_update,
            "overlap_step": a.overlap_step, "clip_with_previous_norm": a.overlap_step,
            "ratio": a.offload_ratio if a.offload_ratio == "auto" else float(a.offload_ratio)}
    if a.dtype != "fp32":
        cfg[a.dtype] = {"enabled": True}
    if a.norm_activations:
        cfg["precision"] = {"norm_activations": a.norm_activations}
    if a.replicas:
        cfg["fault_tolerance"] = {"replicas": 1, "mode": "replay", "replay_on": a.replay_on} if a.replay else \
            {"replicas": 1, "copy_interval": a.replicas}
    engine, _, _, _ = hybrid_ray.initialize(model, config=cfg)
    if a.replicas and a.replay and engine.topology.world_size == 1:  # no buddy: stand in for one
        from replay_loop import loopback_buddy
        loopback_buddy(engine, on_device=a.replay_on == "device")
    if a.impl == "hybrid-pipe":
        # train_batch over one micro-batch (gradient_accumulation_steps 1): the loss is the
        # PipelineModule's loss_fn of its output, as a pipelined script trains
        return lambda x, y: engine.train_batch(iter([(x, y)]))
    return _engine_step(engine)


def _engine_step(engine) -> Callable:
    """One step of a DeepSpeed-style engine (ours or DeepSpeed's): forward, backward, step."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def _fsdp2_step(model: nn.Module, device: torch.device, dt: torch.dtype) -> Callable:
    """FSDP2 as the anchor measured it: each block and the root sharded, reshard after forward.

    Its MixedPrecisionPolicy casts the parameters, so the loop runs without autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True, mp_policy=mp)
    fully_shard(model, reshard_after_forward=True, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    return _torch_step(model, opt, device.type, dt, False, None)


def _deepspeed_step(a: argparse.Namespace, model: nn.Module) -> Callable:
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "zero_optimization": {"stage": a.stage, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}}
    if a.dtype != "fp32":
        cfg[a.dtype] = {"enabled": True}
    if a.offload:  # DeepSpeed steps its own CPU Adam: give it the optimizer config, not a torch one
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return _engine_step(engine)


def measure(a: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.manual_seed(0)
    cfg = GPT_SIZES[a.model] if a.model else CPU_MODEL
    if a.impl == "hybrid-pipe":  # the same GPT as a list of layers (a PipelineModule), one stage
        from hybrid_ray.lm.pipeline_model import gpt_pipeline
        model = gpt_pipeline(cfg).to(device)
    else:
        model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    step = make_step(a, model, device)
    if a.compile:  # after the engine laid the parameters out: compilation is lazy anyway
        for block in model.blocks:
            block.compile()
        if a.compile_head:  # an instance attribute: GPT.forward calls self.head_loss
            model.head_loss = torch.compile(model.head_loss)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (a.mbs, cfg.seq_len), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (a.mbs, cfg.seq_len), device=device, generator=g)
    dt, loss = timed_steps(step, x, y, a.warmup, a.steps, cuda)
    if a.profile:
        _profile(a, step, x, y, rank, cuda)
    tok = a.mbs * cfg.seq_len
    flops_tok = 6 * n_params + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    sharded = a.impl in ("hybrid", "hybrid-pipe", "deepspeed")  # fsdp2 reports no stage
    res = dict(impl=a.impl, stage=a.stage if sharded else None,
               offload=a.offload and sharded, compile=a.compile, compile_head=a.compile and a.compile_head,
               overlap_gather=a.overlap_gather and a.impl == "hybrid", bucket=a.bucket if sharded else None, delayed_update=a.delayed_update and a.offload and sharded,
               model=a.model or "cpu-small", dtype=a.dtype, world=world, mbs=a.mbs,
               params_m=round(n_params / 1e6, 1), step_ms=round(dt * 1e3, 2), tok_s_gpu=round(tok / dt),
               mfu=round(flops_tok * tok / dt / a.peak, 4) if cuda else None,
               peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               loss=round(loss.item(), 3), norm_activations=a.norm_activations if sharded else None,
               replicas=a.replicas if a.impl == "hybrid" else 0, replay=bool(a.replay and a.replicas),
               replay_on=a.replay_on if a.replay and a.replicas else None,
               act_ckpt=a.activation_checkpointing and a.impl == "hybrid",
               offload_ratio=a.offload_ratio if a.offload and a.impl == "hybrid" else None,
               overlap_step=a.overlap_step and a.offload and a.impl == "hybrid")
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def _profile(a: argparse.Namespace, step: Callable, x: torch.Tensor, y: torch.Tensor, rank: int,
             cuda: bool) -> None:
    """Three steps under torch.profiler; rank 0 writes where GPU time goes (kernels, NCCL, idle)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            step(x, y)
        _sync(cuda)
    if rank != 0:
        return
    os.makedirs(a.profile, exist_ok=True)
    name = f"{a.impl}{a.stage if a.impl in ('hybrid', 'hybrid-pipe', 'deepspeed') else ''}_{a.model}"
    name += "_compiled" if a.compile else ""
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(os.path.join(a.profile, f"{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=70))
    trace = os.path.join(a.profile, f"{name}.json")
    prof.export_chrome_trace(trace)
    subprocess.run(["gzip", "-f", trace], check=False)  # traces of a 1.3B step run to tens of MB
    print(f"# profile written to {a.profile}/{name}.txt", flush=True)


# ---- a suite: every implementation, one after the other --------------------------------
def run_suite(a: argparse.Namespace) -> None:
    gpu = not a.suite.endswith("cpu")  # cpu, replicas-cpu: two gloo ranks on this machine
    count = re.search(r"(?:gpu|offload)(\d+)", a.suite)  # gpu2, zero3-gpu2-1.3b, offload1
    nproc = a.nproc or ((int(count.group(1)) if count else 1) if gpu else 2)
    out = a.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "runs", f"{time.strftime('%Y-%m-%d')}-{a.suite}.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rounds: List[List[dict]] = []
    for r in range(a.repeat):
        rounds.append([])
        for spec in SUITES[a.suite]:
            if spec["impl"] == "deepspeed" and not _has("deepspeed"):
                print("# deepspeed not installed: skipped", flush=True)
                continue
            if spec["impl"] == "torch" and nproc > 1:
                continue
            res = _launch(a, spec, nproc, gpu)
            if res:
                res["round"] = r
                rounds[-1].append(res)
                with open(out, "a") as f:
                    f.write(json.dumps(res) + "\n")
    results = rounds[0] if a.repeat == 1 else _medians(rounds)
    print_table(results, BASELINE.get(a.suite), BASELINE_SETTINGS.get(a.suite, {}))
    if a.repeat > 1:
        print(f"(median of {a.repeat} interleaved rounds per implementation; each round's ratios:)")
        for i, row in enumerate(results):
            ratios = [r[i]["tok_s_gpu"] / r[0]["tok_s_gpu"] for r in rounds if i < len(r)]
            print(f"  {row['impl']} {row.get('stage')}: " + " ".join(f"{x:.3f}" for x in ratios))
    print(f"# rows appended to {out}", flush=True)


def _medians(rounds: List[List[dict]]) -> List[dict]:
    """Per implementation (position in the suite), the round with its median throughput."""
    out = []
    for i in range(max(len(r) for r in rounds)):
        rows = sorted((r[i] for r in rounds if i < len(r)), key=lambda row: row["tok_s_gpu"])
        out.append(rows[len(rows) // 2])
    return out


def _launch(a: argparse.Namespace, spec: dict, nproc: int, gpu: bool) -> Optional[dict]:
    args = ["--measure", "--impl", spec["impl"], "--stage", str(spec.get("stage", 1)),
            *(["--offload"] if spec.get("offload") else []),
            *(["--offload-ratio", str(spec["offload_ratio"])] if "offload_ratio" in spec else []),
            *(["--delayed-update"] if spec.get("delayed") else []),
            *(["--activation-checkpointing"] if spec.get("act_ckpt") else []),
            *(["--overlap-step"] if spec.get("overlap_step") else []),
            *(["--compile"] if spec.get("compile") else []),
            *(["--compile-head"] if spec.get("compile_head") else []),
            *(["--overlap-gather"] if spec.get("overlap_gather") else []),
            "--replicas", str(spec.get("replicas", 0)), *(["--replay"] if spec.get("replay") else []),
            *(["--replay-on", spec["replay_on"]] if "replay_on" in spec else []),
            "--dtype", a.dtype or ("bf16" if gpu else "fp32"), "--mbs", str(a.mbs or (8 if gpu else 4)),
            "--steps", str(a.steps or (30 if gpu else 10)), "--warmup", str(a.warmup or (8 if gpu else 3)),
            "--bucket", str(spec.get("bucket", a.bucket)), "--peak", str(a.peak)]
    if a.profile:
        args += ["--profile", a.profile]
    if a.norm_activations or spec.get("norm_activations"):
        args += ["--norm-activations", spec.get("norm_activations") or a.norm_activations]
    if a.model or gpu or spec.get("model"):
        args += ["--model", a.model or spec.get("model") or "350m"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__)] + args
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            print(line, flush=True)
            return res
    print(f"# {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
    return None


def print_table(results: List[dict], baseline: Optional[str] = None, settings: Optional[dict] = None) -> None:
    if not results:
        return
    wanted = (baseline,) if baseline else ("torch", "ddp")
    settings = settings or {}
    base = next((r for r in results if r["impl"] in wanted
                 and all(r.get(k) == v for k, v in settings.items())), results[0])
    print(f"\n{'implementation':<30}{'tokens/s/GPU':>14}{'ratio':>8}{'step ms':>10}{'MFU':>8}{'peak GiB':>10}")
    for r in results:
        name = r["impl"] + (f" ZeRO-{r['stage']}" if r["stage"] is not None else "")
        name += (" +offload" if r.get("offload") else "") + (" DPU" if r.get("delayed_update") else "")
        name += " overlap-step" if r.get("overlap_step") else ""
        name += f" ratio {r['offload_ratio']}" if r.get("offload_ratio") not in (None, "1.0") else ""
        name += " half-norm" if r.get("norm_activations") == "half" else ""
        name += " act-ckpt" if r.get("act_ckpt") else ""
        name += (" compiled+head" if r.get("compile_head") else " compiled") if r.get("compile") else ""
        name += f" overlap-gather/{r['bucket']:.0e}" if r.get("overlap_gather") else ""
        name += (" replay" if r.get("replay") else f" replicas/{r['replicas']}") if r.get("replicas") else ""
        name += " on device" if r.get("replay_on") == "device" else ""
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        mem = r["peak_mem_gb"] if r["peak_mem_gb"] is not None else "-"
        print(f"{name:<30}{r['tok_s_gpu']:>14,}{r['tok_s_gpu'] / base['tok_s_gpu']:>8.3f}"
              f"{r['step_ms']:>10}{mfu:>8}{mem:>10}")
    print(f"(ratio against {base['impl']}{' compiled' if base.get('compile') else ''}; model {base['model']}, {base['dtype']}, world {base['world']})")


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


def main() -> None:
    a = parse()
    if a.measure:
        gpu = torch.cuda.is_available()
        a.dtype = a.dtype or ("bf16" if gpu else "fp32")
        a.mbs, a.steps, a.warmup = a.mbs or (8 if gpu else 4), a.steps or 30, a.warmup or 8
        measure(a)
    elif a.suite:
        run_suite(a)
    else:
        sys.exit("give --suite NAME or --measure (see --help)")


if __name__ == "__main__":
    main()
