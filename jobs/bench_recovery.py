"""Failure recovery: hybrid_ray's ElasticTrainer against Ray Train's TorchTrainer, one invocation.

    python jobs/bench_recovery.py            # 2 CPU workers, the 'small' GPT, rank 1 exits at step 13
    python jobs/bench_recovery.py --out benchmarks/runs/<date>-recovery-cpu.jsonl   # rows as JSON too

With --workers 1 (no buddy) the replicas live on the warm spare instead (cluster/spare_copies.py):
"replicas on the spare" is that way. Five ways at 2 or more workers, the same fault: ours restarting from its newest checkpoint; ours with buddy replicas
(fault_tolerance.replicas: the lost shard comes from the survivor's memory); the same with one
warm spare (a started actor, imports done, replaces the lost one); the same in replay mode (the
buddy steps its copy with each step's gradient instead of receiving it); Ray Train.

Both run the same training function (the 'small' GPT from hybrid_ray.models with our engine at
ZeRO-2, fp32, a fixed global batch, a checkpoint every 5 steps) on a local Ray with two CPU
workers, and in both rank 1's process exits (os._exit) once, at step 13. Ray Train gets
FailureConfig(max_failures=1) and checkpoints through ray.train.report; ours writes them with
engine.save_checkpoint under the run's storage and is told min_workers=max_workers=2. Every
worker logs timestamped records (start, each finished step, the resume step, the fault) to one
file; from them:

  detection: fault -> the driver reports the loss (ours: its event; Ray Train has no such
             event: we report when its new workers start the training function, which includes
             detection and the restart of every worker)
  recovery:  fault -> the first step finished after it
  lost:      steps finished before the fault that had to be computed again
  total:     wall time of the whole run (30 steps)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS, EVERY, FAULT_STEP, BATCH = 30, 5, 13, 8
MODEL, GPU = "small", False  # --model, --device cuda (set in main; the workers get them pickled)
COPY_INTERVAL = 1  # --copy-interval: fault_tolerance.copy_interval of the copy-mode ways


def _log(path: str, **rec) -> None:
    rec["t"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _model(device=None):
    import torch
    from hybrid_ray.models import GPT, GPT_SIZES
    torch.manual_seed(0)
    model = GPT(GPT_SIZES[MODEL])
    return model.to(device) if device is not None else model


def _engine(topology, replicas=False):
    """replicas: False, True (mode copy) or a fault_tolerance.mode."""
    import hybrid_ray
    world = topology.world_size
    cfg = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // world,
           "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "fault_tolerance": {"replicas": int(bool(replicas)),
                               "mode": replicas if isinstance(replicas, str) else "copy",
                               **({} if isinstance(replicas, str) else {"copy_interval": COPY_INTERVAL})},
           "bf16": {"enabled": GPU}, "checkpoint": {"async_save": GPU}}
    from hybrid_ray.cluster.context import warmed
    model = warmed().pop("bench_model", None)
    warm = model is not None
    return hybrid_ray.initialize(model if warm else _model(), config=cfg, topology=topology)[0], warm


def _batch(step: int, rank: int, world: int):
    import torch
    from hybrid_ray.models import GPT_SIZES
    c = GPT_SIZES[MODEL]
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, c.vocab_size, (BATCH, c.seq_len + 1), generator=g)
    per = BATCH // world
    x = x[rank * per:(rank + 1) * per]
    return x[:, :-1], x[:, 1:]


def _steps(engine, rank, world, events, fault_marker, save, lose=(1,)):
    """The shared loop: steps to STEPS, a checkpoint every EVERY steps, one fault: the ranks in
    `lose` exit at FAULT_STEP (once each)."""
    marker = f"{fault_marker}.rank{rank}"
    while engine.global_steps < STEPS:
        step = engine.global_steps
        if rank in lose and step == FAULT_STEP and not os.path.exists(marker):
            open(marker, "w").close()
            _log(events, kind="fault", step=step, rank=rank)
            os._exit(1)
        x, y = _batch(step, rank, world)
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
        _log(events, kind="step", step=engine.global_steps, rank=rank)
        if engine.global_steps % EVERY == 0:
            save(engine)


# ---- ours ----------------------------------------------------------------------------
class OursFn:
    """The training function; a warm spare builds its model while it waits (warm())."""

    def __init__(self, events: str, marker: str, replicas, lose: tuple):
        self.args = (events, marker, replicas, lose)

    def warm(self) -> None:
        import torch
        from hybrid_ray.cluster.context import warmed
        warmed()["bench_model"] = _model(torch.device("cuda", 0) if GPU else None)

    def __call__(self, ctx):
        return ours_fn(ctx, *self.args)


def ours_fn(ctx, events: str, marker: str, replicas, lose: tuple):
    entered = time.time()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the worker's log
    engine, warm = _engine(ctx.topology, replicas)
    built = time.time()
    ckpt = os.path.join(ctx.storage_path, ctx.run_name, "checkpoints")
    path, _ = engine.load_checkpoint(ckpt)
    source = None if path is None else "memory" if path.startswith("memory:") else "disk"
    _log(events, kind="start", step=engine.global_steps, rank=ctx.rank, source=source, entered=entered, warm=warm,
         build_s=round(built - entered, 2), load_s=round(time.time() - built, 2))

    def save(e):
        e.save_checkpoint(ckpt)
        ctx.step_done(e.global_steps)
    _steps(engine, ctx.rank, ctx.world_size, events, marker, save, lose)
    engine.close()


def run_ours(work: str, name: str = "ours", replicas=False, spares: int = 0,
             workers: int = 2, lose: tuple = (1,)) -> Dict[str, float]:
    from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
    events, marker = os.path.join(work, f"{name}.jsonl"), os.path.join(work, f"{name}.fault")
    seen: List[tuple] = []
    trainer = ElasticTrainer(OursFn(events, marker, replicas, lose),
                             ScalingConfig(min_workers=workers, max_workers=workers, spare_workers=spares,
                                           use_gpu=GPU, resources_per_worker=
                                           {"CPU": 1, "GPU": 0.5} if GPU else None),
                             FailureConfig(max_failures=1, collective_timeout_s=30.0),
                             storage_path=os.path.join(work, name), run_name="bench",
                             on_event=lambda msg: (seen.append((time.time(), msg)), _said(work, name, msg)))
    t0 = time.time()
    trainer.fit()
    total = time.time() - t0
    detected = next(t for t, msg in seen if "lost" in msg or "failed" in msg)
    return _measure(events, total, detected)


def _said(work: str, name: str, msg: str) -> None:
    print(f"  [{name}] {msg}", flush=True)
    with open(os.path.join(work, "events.txt"), "a") as f:
        f.write(f"{time.time():.3f} [{name}] {msg}\n")


# ---- Ray Train -----------------------------------------------------------------------------
def ray_train_fn(config: dict):
    import ray.train
    from hybrid_ray.engine import Topology
    events, marker = config["events"], config["marker"]
    topo = Topology.from_environment()
    engine, _ = _engine(topo)
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            engine.load_checkpoint(d)
    _log(events, kind="start", step=engine.global_steps, rank=topo.rank)

    def save(e):
        # Every rank writes its part into one directory (this machine's disk is shared by the
        # workers); rank 0 hands it to Ray Train, which copies it into the run's storage.
        d = os.path.join(config["scratch"], f"step{e.global_steps}")
        e.save_checkpoint(d)
        ckpt = ray.train.Checkpoint.from_directory(d) if topo.rank == 0 else None
        ray.train.report({"step": e.global_steps}, checkpoint=ckpt)
    _steps(engine, topo.rank, topo.world_size, events, marker, save)
    engine.close()


def run_ray_train(work: str) -> Dict[str, float]:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer
    events, marker = os.path.join(work, "raytrain.jsonl"), os.path.join(work, "raytrain.fault")
    trainer = TorchTrainer(ray_train_fn, train_loop_config={"events": events, "marker": marker,
                                                             "scratch": os.path.join(work, "rt_scratch")},
                           torch_config=TorchConfig(backend="gloo"),
                           scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=ray.train.RunConfig(
                               name="bench", storage_path=os.path.join(work, "raytrain"),
                               failure_config=ray.train.FailureConfig(max_failures=1)))
    t0 = time.time()
    trainer.fit()
    total = time.time() - t0
    return _measure(events, total, None)


# ---- the figures -----------------------------------------------------------------------------
def _measure(events: str, total: float, detected) -> Dict[str, float]:
    recs = [json.loads(line) for line in open(events)]
    fault = next(r for r in recs if r["kind"] == "fault")
    start = next(r for r in recs if r["kind"] == "start" and r["t"] > fault["t"])
    restart, resumed = start["t"], start["step"]
    # A survivor can finish the step the victim had finished just after the fault's record:
    # count steps by the restart, not by the fault's timestamp.
    before = max(r["step"] for r in recs if r["kind"] == "step" and r["t"] < restart)
    first = min(r["t"] for r in recs if r["kind"] == "step" and r["t"] > restart)
    return {"detection_s": round((detected or restart) - fault["t"], 2),
            "restart_s": round(restart - fault["t"], 2),
            "recovery_s": round(first - fault["t"], 2),
            "steps_lost": before - resumed, "total_s": round(total, 1),
            "resumed_from": start.get("source") or "disk",
            # the restart's parts: the new group's training function entered, the engine built
            # (model included, unless a spare built it while it waited), the state loaded
            "enter_s": round(start.get("entered", restart) - fault["t"], 2),
            "build_s": start.get("build_s"), "load_s": start.get("load_s")}


def _python_path() -> str:
    """The repository first, then whatever PYTHONPATH already holds (on a GPU machine, the
    carried Ray itself: replacing it would leave the workers without Ray)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def _ways(work: str, args: argparse.Namespace, lose: tuple) -> Dict[str, Any]:
    """The ways this invocation runs, by row name: each a call that runs it."""
    n = dict(workers=args.workers, lose=lose)
    spares = f" + {len(lose)} spare(s)"
    ways: Dict[str, Any] = {"hybrid_ray, checkpoint": lambda: run_ours(work, **n)}
    if args.workers > 1:  # one worker has no buddy: nothing survives in memory
        ways["hybrid_ray, replicas"] = lambda: run_ours(work, "replicas", replicas=True, **n)
    ways[f"hybrid_ray, {'replicas' if args.workers > 1 else 'checkpoint'}{spares}"] = \
        lambda: run_ours(work, "spare", replicas=args.workers > 1, spares=len(lose), **n)
    if args.workers == 1:  # no buddy: the spare holds the lone worker's copies
        ways[f"hybrid_ray, replicas on the spare{spares}"] = \
            lambda: run_ours(work, "spare-copy", replicas=True, spares=len(lose), **n)
    if args.workers > 1:  # the buddy steps its copy with each step's gradient instead
        ways[f"hybrid_ray, replay{spares}"] = \
            lambda: run_ours(work, "replay", replicas="replay", spares=len(lose), **n)
    if not args.skip_ray_train and args.workers == 2 and lose == (1,) and not GPU:
        ways["Ray Train TorchTrainer"] = lambda: run_ray_train(work)
    if args.ways:
        words = args.ways.split(",")
        ways = {k: v for k, v in ways.items() if any(w in k for w in words)}
        if not ways:
            raise SystemExit(f"--ways {args.ways!r}: no way's name contains any of these words")
    return ways


def main() -> None:
    global STEPS, EVERY, FAULT_STEP, MODEL, GPU, COPY_INTERVAL
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append one JSON row per way to this file")
    p.add_argument("--skip-ray-train", action="store_true", help="leave Ray Train's row out")
    p.add_argument("--workers", type=int, default=2, help="workers (2 or 4; Ray Train runs at 2 only)")
    p.add_argument("--lose", default="1", help="ranks that exit together, e.g. 1,3 (buddies apart: "
                   "rank r's copy lives on r+1) or 1,2 (a rank and its buddy)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: GPU workers, half a GPU each (a spare fits beside one worker), bf16")
    p.add_argument("--model", default="small", help="a GPT_SIZES name (350m on one H200)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--every", type=int, default=EVERY, help="checkpoint interval")
    p.add_argument("--fault-step", type=int, default=FAULT_STEP)
    p.add_argument("--copy-interval", type=int, default=COPY_INTERVAL,
                   help="fault_tolerance.copy_interval of the copy-mode ways")
    p.add_argument("--ways", default=None, help="run only these ways: comma-separated words each "
                   "way's name must contain, e.g. 'spare' or 'checkpoint,replay'")
    p.add_argument("--keep", default=None, help="the work folder (the ways' event files, checkpoints "
                   "and every driver event as events.txt) here instead of a temporary one")
    args = p.parse_args()
    lose = tuple(int(r) for r in args.lose.split(","))
    STEPS, EVERY, FAULT_STEP, MODEL, GPU = args.steps, args.every, args.fault_step, args.model, args.device == "cuda"
    COPY_INTERVAL = args.copy_interval
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from hybrid_ray.cluster.local import start_local
    start_local(num_cpus=args.workers + 2 * len(lose), num_gpus=1 if GPU else 0, include_dashboard=False, log_to_driver=False,  # all on 127.0.0.1
                runtime_env={"env_vars": {"PYTHONPATH": _python_path()}})
    work = args.keep or tempfile.mkdtemp(prefix="hybrid_ray_recovery_")
    os.makedirs(work, exist_ok=True)
    rows = {}
    for name, run in _ways(work, args, lose).items():
        rows[name] = r = run()
        if args.out:  # row by row: a machine taken back mid-invocation keeps the ways that finished
            with open(args.out, "a") as f:
                f.write(json.dumps({"impl": name, "workers": args.workers, "lost_ranks": list(lose),
                                    "model": MODEL, "device": args.device, "steps": STEPS,
                                    "fault_step": FAULT_STEP, "checkpoint_every": EVERY,
                                    "copy_interval": COPY_INTERVAL, **r}) + "\n")
    ray.shutdown()
    print(f"\n{'':<30}{'detection s':>12}{'restart s':>11}{'recovery s':>12}{'steps lost':>12}{'total s':>9}"
          "  resumed from")
    for name, r in rows.items():
        print(f"{name:<30}{r['detection_s']:>12}{r['restart_s']:>11}{r['recovery_s']:>12}"
              f"{r['steps_lost']:>12}{r['total_s']:>9}  {r['resumed_from']}  (entered "
              f"{r.get('enter_s', '-')} s, build {r.get('build_s', '-')} s, load {r.get('load_s', '-')} s)")
    print(f"({args.workers} {args.device} worker(s), '{MODEL}' GPT, checkpoint every {EVERY} steps, rank(s) {args.lose} "
          f"exit at step {FAULT_STEP}; "
          f"Ray Train's 'detection' is when its new workers start)")


if __name__ == "__main__":
    main()
