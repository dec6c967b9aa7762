"""Throughput of tensor x pipeline x data-parallel layouts: hybrid_ray (ZeRO with tensor and
pipeline parallelism, the GPT as a PipelineModule through train_batch) against the torch-native
composition of the same (jobs/torch_native.py: FSDP2 + DTensor TP + torch.distributed.pipelining,
rows with impl "torch_native"), on the project's GPT, one invocation.

    python jobs/bench_layouts.py --suite layouts-gpu8-6.7b # 8 GPUs, seq 2048: (1,1,8) ZeRO-3, (2,1,4),
                                                           # (4,2,1), (2,2,2), and (1,2,4) with DeepSpeed
    python jobs/bench_layouts.py --suite layouts-gpu8-13b  # the same at 13B
    python jobs/bench_layouts.py --suite layouts-gpu1      # 1 GPU: both stacks at (1,1,1), 350M
    python jobs/bench_layouts.py --suite layouts-cpu8      # 8 gloo processes on CPU, a small GPT
One measurement (under torchrun, world = T*P*dp):
    torchrun --nproc_per_node=8 jobs/bench_layouts.py --measure --impl hybrid --layout 2,2,2 --model 6.7b

A step trains dp x micro x mbs sequences (`--micro` micro-batches per data-parallel rank go
through the pipeline); tokens/s per GPU divide the step's tokens by the world size, and MFU
counts the whole GPT's FLOPs (6N + 12 L d T per token). Rows go to benchmarks/runs/ as JSON lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_timing import timed_steps  # noqa: E402
from hybrid_ray.models import GPT, GPT_SIZES, GPTConfig  # noqa: E402

LR, WD, CLIP = 3e-4, 0.1, 1.0
CPU_MODEL = GPTConfig(n_layer=4, n_head=4, d_model=64, vocab_size=512, seq_len=64)
# (T, P, dp, hybrid ZeRO stage): the four, and (1,2,4) where DeepSpeed's pipeline runs too
_LAYOUTS8 = [(1, 1, 8, 3), (2, 1, 4, 1), (4, 2, 1, 1), (2, 2, 2, 1), (1, 2, 4, 1)]


def _gpu8(model: str) -> list:
    rows = []
    for (t, p, d, s) in _LAYOUTS8:
        impls = ("torch_native", "hybrid") + (("deepspeed",) if t == 1 and p > 1 else ())
        rows += [dict(impl=impl, layout=(t, p, d), stage=s, model=model) for impl in impls]
    return rows


SUITES = {
    "layouts-gpu8-6.7b": _gpu8("6.7b"),
    "layouts-gpu8-13b": _gpu8("13b"),
    "layouts-gpu1": [dict(impl="torch_native", layout=(1, 1, 1), model="350m"),
                     dict(impl="hybrid", layout=(1, 1, 1), stage=1, model="350m"),
                     dict(impl="deepspeed", layout=(1, 1, 1), stage=1, model="350m")],
    "layouts-cpu8": [dict(impl=impl, layout=(2, 2, 2), stage=1) for impl in ("torch_native", "hybrid")],
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=list(SUITES))
    p.add_argument("--measure", action="store_true", help="one measurement (under torchrun)")
    p.add_argument("--impl", choices=["hybrid", "torch_native", "deepspeed"], default="hybrid")
    p.add_argument("--layout", default="1,1,1", help="T,P,dp: tensor, pipeline and data-parallel sizes")
    p.add_argument("--stage", type=int, default=1, help="hybrid: ZeRO stage (deepspeed: at most 1)")
    p.add_argument("--model", default=None, help=f"one of {list(GPT_SIZES)} (default: a small CPU GPT)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's; the "
                   "layouts-gpu8 suites: 2048)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--mbs", type=int, default=None, help="micro-batch size (default 2 on GPUs, 2 on CPUs)")
    p.add_argument("--micro", type=int, default=None, help="micro-batches per step and data-parallel rank "
                   "(default: 2 x the pipeline size)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s per GPU for MFU")
    p.add_argument("--out", default=None, help="append result lines (JSON) to this file")
    return p.parse_args()


def model_config(a: argparse.Namespace) -> GPTConfig:
    cfg = GPT_SIZES[a.model] if a.model else CPU_MODEL
    return dataclasses.replace(cfg, seq_len=a.seq) if a.seq else cfg


def _hybrid_step(a: argparse.Namespace, cfg: GPTConfig, layout: tuple, dtype: str) -> Callable:
    import hybrid_ray
    import hybrid_ray.zero
    from hybrid_ray.lm.pipeline_model import gpt_pipeline
    t, p, _ = layout
    config = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": a.micro,
              "tensor_model_parallel_size": t, "pipeline_model_parallel_size": p,
              "pipeline": {"schedule": "1f1b"}, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
              "zero_optimization": {"stage": a.stage}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    # at ZeRO-3 each parameter is partitioned as it is made (zero.Init), as a large model's
    # script builds it: eight ranks building 13B whole would need 400 GB of host memory
    with hybrid_ray.zero.Init(config_dict_or_path=config):
        model = gpt_pipeline(cfg, num_stages=p, seed_layers=True)
    engine = hybrid_ray.initialize(model, config=config)[0]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batches = zip(x.split(a.mbs), y.split(a.mbs))
        return engine.train_batch(iter(batches))
    return step


def _deepspeed_step(a: argparse.Namespace, cfg: GPTConfig, layout: tuple, dtype: str) -> Callable:
    """DeepSpeed's pipeline engine on the same layers (its own LayerSpec / TiedLayerSpec). It
    accepts ZeRO-1 at most with a pipeline and has no tensor parallelism of its own (that needs
    Megatron's model-parallel unit), so only T = 1 layouts."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from hybrid_ray.lm.pipeline_model import Embeddings, GPTBlock, head, lm_loss
    t, p, _ = layout
    if t != 1:
        sys.exit(f"deepspeed: layout {layout}: its pipeline engine has no tensor parallelism of its own")
    layers = [TiedLayerSpec("embed", Embeddings, cfg), *[LayerSpec(GPTBlock, cfg) for _ in range(cfg.n_layer)],
              LayerSpec(torch.nn.LayerNorm, cfg.d_model),
              TiedLayerSpec("embed", Embeddings, cfg, forward_fn=head, tied_weight_attr="wte.weight")]
    deepspeed.init_distributed()  # its own communication layer over the group measure() made
    torch.manual_seed(0)
    model = PipelineModule(layers=layers, loss_fn=lm_loss, num_stages=p, partition_method="parameters")
    config = {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": a.micro,
              "gradient_clipping": CLIP, "steps_per_print": 10**9, "zero_optimization": {"stage": min(a.stage, 1)}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    # torch's fused AdamW, as the other stacks step: DeepSpeed's own FusedAdam is built at run
    # time and its build fails on a GPU machine whose arch list says "9.0a"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=torch.cuda.is_available())
    engine = deepspeed.initialize(model=model, optimizer=opt, config=config)[0]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return engine.train_batch(iter(zip(x.split(a.mbs), y.split(a.mbs))))
    return step


def _native_step(a: argparse.Namespace, cfg: GPTConfig, layout: tuple, dtype: str,
                 device: torch.device) -> Callable:
    from torch_native import Layout, build
    small = cfg.d_model * cfg.n_layer <= 4096 * 8  # whole on every rank only while that is cheap
    run = build(cfg, Layout(*layout), a.micro, device, torch.bfloat16 if dtype == "bf16" else torch.float32,
                exact=small, lr=LR, weight_decay=WD, clip=CLIP)
    return run.step


def measure(a: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    layout = tuple(int(v) for v in a.layout.split(","))
    t, p, d = layout
    if t * p * d != dist.get_world_size():
        sys.exit(f"--layout {a.layout}: T*P*dp = {t * p * d}, but the world has {dist.get_world_size()} processes")
    cfg, dtype = model_config(a), a.dtype or ("bf16" if cuda else "fp32")
    if a.impl == "torch_native":
        step = _native_step(a, cfg, layout, dtype, device)
    else:
        step = (_hybrid_step if a.impl == "hybrid" else _deepspeed_step)(a, cfg, layout, dtype)
    # the same sequences on every rank: tensor-parallel peers must see the same ones, and the
    # two stacks number their data-parallel ranks differently (the speed is the same)
    g = torch.Generator(device=device).manual_seed(0)
    rows = a.micro * a.mbs
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), device=device, generator=g)
    dt, loss = timed_steps(step, x, y, a.warmup, a.steps, cuda)
    _report(a, cfg, layout, dtype, dt, loss, cuda)
    # The step holds the stack's collectives' state (FSDP2, the pipeline schedule's works):
    # freed here, while the interpreter is whole, and every rank done with every peer before
    # the groups go. A torch-native run once aborted at exit (SIGABRT, "terminate called
    # without an active exception") after its steps, 1 run in about 20 of the suite's.
    del step, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _report(a: argparse.Namespace, cfg: GPTConfig, layout: tuple, dtype: str, dt: float,
            loss: Optional[torch.Tensor], cuda: bool) -> None:
    world = dist.get_world_size()
    with torch.device("meta"):
        n_params = GPT(cfg).num_params()
    tokens = layout[2] * a.micro * a.mbs * cfg.seq_len  # the step's, all data-parallel ranks
    flops_tok = 6 * n_params + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    on = torch.device("cuda", torch.cuda.current_device()) if cuda else None  # NCCL reduces device tensors
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=on)
    last = torch.tensor([float(loss) if loss is not None else float("-inf")], device=on)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(last, op=dist.ReduceOp.MAX)  # the last stage's (dp rank 0 or another: any)
    res = dict(impl=a.impl, stage={"hybrid": a.stage, "deepspeed": min(a.stage, 1)}.get(a.impl), tp=layout[0], pp=layout[1],
               dp=layout[2], model=a.model or "cpu-small", seq=cfg.seq_len, dtype=dtype, world=world,
               mbs=a.mbs, micro=a.micro, params_m=round(n_params / 1e6, 1), step_ms=round(dt * 1e3, 2),
               tok_s_gpu=round(tokens / dt / world), mfu=round(flops_tok * tokens / dt / world / a.peak, 4) if cuda else None,
               peak_mem_gb=round(peak.item(), 2) if cuda else None, loss=round(last.item(), 3))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)


def run_suite(a: argparse.Namespace) -> List[dict]:
    gpu = not a.suite.endswith("cpu8")
    out = a.out or os.path.join(ROOT, "benchmarks", "runs", f"{time.strftime('%Y-%m-%d')}-{a.suite}.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for spec in SUITES[a.suite]:
        res = _launch(a, spec, gpu)
        if res:
            rows.append(res)
            with open(out, "a") as f:
                f.write(json.dumps(res) + "\n")
    _table(rows)
    print(f"# rows appended to {out}", flush=True)
    return rows


def _launch(a: argparse.Namespace, spec: dict, gpu: bool) -> Optional[dict]:
    t, p, d = spec["layout"]
    args = ["--measure", "--impl", spec["impl"], "--layout", f"{t},{p},{d}", "--stage", str(spec.get("stage", 1)),
            "--mbs", str(a.mbs or 2), "--micro", str(a.micro or 2 * p), "--steps", str(a.steps or (10 if gpu else 3)),
            "--warmup", str(a.warmup or (3 if gpu else 1)), "--peak", str(a.peak)]
    model = a.model or spec.get("model")
    args += (["--model", model] if model else []) + (["--dtype", a.dtype] if a.dtype else [])
    seq = a.seq or (2048 if a.suite.startswith("layouts-gpu8") else None)
    args += ["--seq", str(seq)] if seq else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={t * p * d}",
           os.path.abspath(__file__)] + args
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            print(line, flush=True)
            return json.loads(line[7:])
    print(f"# {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
    return None


def _table(rows: List[dict]) -> None:
    """Each hybrid row against the torch-native row of the same model and layout."""
    print(f"\n{'model':<10}{'T,P,dp':<9}{'implementation':<22}{'tokens/s/GPU':>13}{'ratio':>8}{'MFU':>8}{'peak GiB':>10}")
    for r in rows:
        base = next((b for b in rows if b["impl"] == "torch_native" and b["model"] == r["model"]
                     and (b["tp"], b["pp"], b["dp"]) == (r["tp"], r["pp"], r["dp"])), None)
        ratio = f"{r['tok_s_gpu'] / base['tok_s_gpu']:.3f}" if base else "-"
        name = r["impl"] + (f" ZeRO-{r['stage']}" if r["stage"] is not None else "")
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        shape = f"{r['tp']},{r['pp']},{r['dp']}"
        print(f"{r['model']:<10}{shape:<9}{name:<22}{r['tok_s_gpu']:>13,}{ratio:>8}{mfu:>8}"
              f"{r['peak_mem_gb'] if r['peak_mem_gb'] is not None else '-':>10}")


def main() -> None:
    a = parse()
    if a.measure:
        layout = [int(v) for v in a.layout.split(",")]
        a.mbs, a.micro = a.mbs or 2, a.micro or 2 * layout[1]
        a.steps, a.warmup = a.steps or 10, a.warmup or 3
        measure(a)
    elif a.suite:
        run_suite(a)
    else:
        sys.exit("give --suite NAME or --measure (see --help)")


if __name__ == "__main__":
    main()
