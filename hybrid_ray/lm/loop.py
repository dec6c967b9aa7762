"""The language-model run: a GPT on a prepared token dataset, trained by the engine, top to bottom.

Every rank calls `train(job, ctx)`. Under torchrun the process group comes from RANK/WORLD_SIZE;
a Ray worker passes the topology of the group it already joined in `ctx` (setup.RunContext).
Nothing here parses arguments or starts processes: launch.py does that. Only rank 0 prints.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from hybrid_ray.data.prepare import bits_per_byte, split_entropy
from hybrid_ray.engine import Topology
from hybrid_ray.engine.pipe import PipelineModule
from hybrid_ray.cluster.compression_follower import DirectiveFollower
from hybrid_ray.cluster.records import LinkProbe, Params, Text
from hybrid_ray.engine.flops.report import format_report
from hybrid_ray.lm.evaluate import all_sum, evaluate, generate
from hybrid_ray.lm.job import Job, console_interval, for_world, uses_fp16
from hybrid_ray.lm.setup import (Run, RunContext, RunLog, build, checkpoint_dir, prepare_data,
                                 resume, set_threads)
from hybrid_ray.profiling.speedometer import Speedometer

Batch = Tuple[torch.Tensor, torch.Tensor]


class DidNotLearnError(RuntimeError):
    """The final validation loss is not below the unigram baseline: the model learned no context."""


@dataclass(frozen=True)
class RunResult:
    """What a run achieved (every rank returns the same numbers)."""

    steps: int
    train_loss: float  # mean over the last logging interval (nan if no step ran in this process)
    val_loss: float  # whole validation split, nats/token
    unigram_nats: float  # baseline: entropy of the validation tokens
    train_seconds: float
    tokens_per_s: float
    sample: str  # the generated text
    stopped: bool = False  # ended early at a checkpoint because RunContext.stop said so


def train(job: Job, ctx: Optional[RunContext] = None) -> RunResult:
    """Run the whole job on this rank; every rank returns the same RunResult."""
    ctx = ctx or RunContext()
    threads = set_threads(ctx.threads)
    topo = ctx.topology or Topology.from_environment()
    log = RunLog(topo.rank, job.train.out_dir, ctx.report, echo=not ctx.driver_prints)
    if topo.rank == 0:  # the engine reports skipped steps and checkpoints through logging
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    meta = prepare_data(job.data, topo, log)
    job = for_world(job, topo.world_size)
    run = build(job, topo, meta, ctx.resume)
    resume(run, job, ctx, log)
    _header(job, run, threads, log)
    train_loss, seconds, tok_s, stopped = train_steps(job, run, log, ctx)
    if stopped:  # the checkpoint just written holds everything; the driver re-forms the group
        return RunResult(run.engine.global_steps, train_loss, float("nan"), float("nan"),
                         seconds, tok_s, "", stopped=True)
    val_loss = evaluate(run.engine, run.val, None)
    baseline = split_entropy(run.val, run.tokenizer.vocab_size)
    val_meta = meta["splits"]["val"]
    log.record(step=run.engine.global_steps, final_val_loss=val_loss, unigram_baseline=baseline)
    ran = not math.isnan(train_loss)  # nan: resumed at the last step, nothing left to train
    trained = f"train loss {train_loss:.4f}" if ran else "no step in this run"
    speed = f" | {seconds:.0f} s training, {tok_s:,.0f} tok/s" if ran else ""
    log.say(f"final: {trained} | val loss {val_loss:.4f} nats/token "
            f"({bits_per_byte(val_loss, val_meta):.3f} bits/byte, all {len(run.val)} windows) | "
            f"unigram baseline {baseline:.4f} nats/token ({bits_per_byte(baseline, val_meta):.3f} "
            f"bits/byte){speed}")
    text = _sample(job, run, log)
    if topo.world_size > 1:
        # Ranks leave together: none tears down the group while another still uses it.
        dist.barrier(group=topo.group)
    # Unhook the engine from the model: a Ray worker calls train() again in the same process
    # after each membership change.
    run.engine.close()
    return RunResult(run.engine.global_steps, train_loss, val_loss, baseline, seconds, tok_s, text)


def not_learned(job: Job, r: RunResult) -> Optional[str]:
    """Why a finished run fails train.require_below_baseline, else None. Checked by whoever
    ends the run (the Ray driver, torchrun's ranks), after it is recorded: a worker that raised
    it would only be restarted to evaluate the same weights again."""
    if not job.train.require_below_baseline or r.stopped or r.val_loss < r.unigram_nats:
        return None
    return (f"final val loss {r.val_loss:.4f} is not below the unigram baseline "
            f"{r.unigram_nats:.4f} nats/token: the model learned nothing from context (train "
            "longer or raise the lr; for a run too short to learn, --set "
            "train.require_below_baseline=false)")


def batches(run: Run) -> Iterator[Batch]:
    """Micro-batches forever: each pass over the loader runs to the end of an epoch."""
    while True:
        yield from run.loader


def train_steps(job: Job, run: Run, log: RunLog,
                ctx: Optional[RunContext] = None) -> Tuple[float, float, float, bool]:
    """The optimizer steps from the engine's current step, with logging, evaluation, checkpoints.

    Returns (train loss over the last logging interval, wall seconds, training tokens/s, whether
    ctx.stop ended the run at a checkpoint); the tokens/s leave evaluation and checkpoint time out.
    """
    ctx = ctx or RunContext()
    follower = _follower(run, ctx, log)
    # Throughput, TFLOPS, MFU and memory every log interval (flops measured once on a real
    # step), recorded with the losses: metrics.jsonl, the driver, MLflow.
    flops_sent = False
    speed = Speedometer(run.engine, interval=run.engine.config.steps_per_print, verbose=False,
                        tokens_per_sample=job.model.seq_len,
                        on_report=lambda rec: log.record(**{k: v for k, v in rec.items() if k != "loss"}))
    engine, steps, every = run.engine, job.train.steps, run.engine.config.steps_per_print
    console, logged = console_interval(job), engine.global_steps
    tokens_per_step = engine.train_batch_size() * job.model.seq_len
    data = batches(run)
    # Summed on the device and read once per log line: a float(loss) per micro-step would be a
    # host-device sync per micro-step on a GPU.
    loss_sum = torch.zeros(2, dtype=torch.float32, device=engine.device)
    last_loss, paused, first = float("nan"), 0.0, engine.global_steps
    start = t_log = time.perf_counter()
    for step in range(first + 1, steps + 1):
        one_step(engine, data, loss_sum)
        if follower is not None:
            follower.after_step()
        if step % every == 0 or step == steps:
            summed = all_sum(loss_sum.clone(), engine)  # the mean over every rank's micro-batches
            last_loss = float(summed[0] / summed[1])
            now = time.perf_counter()
            _log_step(run, log, step, steps, last_loss, (step - logged) * tokens_per_step / (now - t_log),
                      console)
            loss_sum.zero_()
            if follower is not None:
                log.send(follower.interval(step, step - logged, now - t_log))
                follower.sync(step)  # a new compression setting applies from the next step on
            t_log, logged = time.perf_counter(), step
        speed.update()
        flops_sent = flops_sent or _send_flops_report(run, log)
        if ctx.on_step is not None:
            ctx.on_step(step)
        t0 = time.perf_counter()
        saved = _between_steps(job, run, log, step, ctx.flush)
        paused += time.perf_counter() - t0
        t_log += time.perf_counter() - t0
        if saved and step != steps and ctx.stop is not None and ctx.stop():
            log.say(f"stopping at step {step} (checkpoint written) as the driver asked")
            steps = step
            break
    seconds = time.perf_counter() - start
    trained = (steps - first) * tokens_per_step
    return last_loss, seconds, trained / max(seconds - paused, 1e-9), steps != job.train.steps


def one_step(engine, data: Iterator[Batch], loss_sum: torch.Tensor) -> None:
    """One optimizer step over the next micro-batches of `data`; adds (loss, count) to
    `loss_sum`, whose sum over the data-parallel ranks gives the mean loss. A PipelineModule
    (cut into stages or not) steps through train_batch, whose loss is already the mean over
    the replicas: counted once per rank, the sum over them is that mean again."""
    if isinstance(engine.module, PipelineModule):
        loss_sum[0] += engine.train_batch(data).float()
        loss_sum[1] += 1
        return
    for _ in range(engine.gradient_accumulation_steps()):
        x, y = next(data)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        loss_sum[0] += loss.detach().float()
        loss_sum[1] += 1


def _send_flops_report(run: Run, log: RunLog) -> bool:
    """Once the Speedometer's profile of a training step exists, rank 0 sends its per-module
    report to the driver (an MLflow artifact there). Returns whether the profile exists (the
    caller stops asking then: once per run)."""
    profile = run.engine.flops_profiler.last
    if profile is None:
        return False
    if log.report is not None and log.rank == 0:
        log.send(Text("reports/flops.txt", format_report(profile, module_depth=2), run.engine.global_steps))
    return True


def _between_steps(job: Job, run: Run, log: RunLog, step: int,
                   flush: Optional[Callable[[], bool]] = None) -> bool:
    """Periodic evaluation, and checkpoints (every save_interval steps and after the last),
    each after `flush` (the driver has every record sent so far: a worker lost after the
    checkpoint loses no record that the resumed run will not send again).
    Returns whether a checkpoint was written."""
    t = job.train
    if step % t.eval_interval == 0 and step != t.steps:
        val_loss = evaluate(run.engine, run.val, t.eval_samples)
        log.record(step=step, val_loss=val_loss)
        log.progress(f"eval  step {step}: val loss {val_loss:.4f} ({t.eval_samples or 'all'} windows)")
    ckpt = checkpoint_dir(job)
    if ckpt is not None and (step == t.steps or (t.save_interval and step % t.save_interval == 0)):
        if flush is not None and not flush():
            log.say(f"warning: step {step}: the driver has not acknowledged every record; "
                    "checkpointing anyway")
        run.engine.save_checkpoint(ckpt)  # the engine logs where it went
        return True
    return False


def _log_step(run: Run, log: RunLog, step: int, total: int, loss: float, tok_s: float,
              console: int = 1) -> None:
    """The step's record (every steps_per_print: MLflow's points), and a console line every
    `console` steps and at the last (about 20 a run: console_interval)."""
    engine = run.engine
    norm = engine.get_global_grad_norm()  # None before the first optimizer step
    lr = engine.get_lr()[0]
    scale = engine.loss_scale if uses_fp16(engine.config) else None  # 1 by construction otherwise
    log.record(step=step, train_loss=loss, lr=lr, loss_scale=scale, grad_norm=norm, tokens_per_s=tok_s,
               skipped_steps=engine.skipped_steps, **_comm_record(engine))
    if step % console == 0 or step == total:
        shown = "" if scale is None else f"loss scale {scale:g} | "
        log.progress(f"step {step:>5}/{total} | loss {loss:.4f} | lr {lr:.2e} | {shown}"
                     f"grad norm {'-' if norm is None else f'{norm:.3f}'} | {tok_s:,.0f} tok/s")


def _follower(run: Run, ctx: RunContext, log: RunLog) -> Optional[DirectiveFollower]:
    """With `gradient_compression.type: auto` under a driver (ctx.directive), follow its
    choices: measure the link (rank 0 reports it) and start with the setting now in force."""
    engine = run.engine
    if ctx.directive is None or engine.config.gradient_compression.type != "auto":
        return None
    follower = DirectiveFollower(engine, ctx.directive, log.say)
    world = engine.topology.world_size
    bandwidth = follower.probe_link() if world > 1 else None
    log.send(LinkProbe(world, bandwidth))
    follower.sync(engine.global_steps)
    return follower


def _comm_record(engine) -> dict:
    """Gradient traffic of this rank's last step (nothing with one rank: nothing is reduced),
    and the step-time split the driver's compression decisions use where the engine has it."""
    stats = engine.compression_stats()
    if not stats.get("bytes_sent"):
        return {}
    out = {"grad_bytes_sent": stats["bytes_sent"], "compression_ratio": stats["ratio"]}
    out.update({k: stats[k] for k in ("step_s", "comm_wait_s", "compress_s") if k in stats})
    return out


def _header(job: Job, run: Run, threads: int, log: RunLog) -> None:
    m, engine, meta = job.model, run.engine, run.meta
    cfg, topo = engine.config, engine.topology
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    world = topo.world_size * engine.tp_world_size * (engine.module.num_stages if engine.is_pipe_parallel() else 1)
    split = "" if world == topo.world_size else (f" (tensor {engine.tp_world_size} x pipeline "
                                                 f"{world // topo.world_size // engine.tp_world_size} per replica)")
    log.say(f"hybrid_ray LM run: {world} process(es){split} on {topo.device.type} "
            f"({dist.get_backend() if dist.is_initialized() else 'no process group'}), "
            f"{threads} thread(s) each, torch {torch.__version__}, Python {sys.version.split()[0]}")
    log.say(f"data:   {job.data.path} from {meta['source']}: {run.tokenizer.kind} tokenizer, "
            f"vocabulary {run.tokenizer.vocab_size}; train {tr['files']} files, {tr['tokens']:,} "
            f"tokens ({len(run.loader.dataset):,} windows); val {va['files']} files, "
            f"{va['tokens']:,} tokens ({len(run.val):,} windows)")
    log.say(f"model:  GPT {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, context "
            f"{m.seq_len} tokens: {run.num_params / 1e6:.2f} M parameters")
    log.send(Params({"model.num_params": run.num_params,
                     "engine.precision": cfg.base_dtype, "engine.zero_stage": cfg.zero_optimization.stage}))
    sched = cfg.scheduler.type if cfg.scheduler else "constant lr"
    log.say(f"engine: {cfg.base_dtype}, ZeRO stage {cfg.zero_optimization.stage}, "
            f"{cfg.optimizer.type} {cfg.optimizer.params}, {sched}, clip {cfg.gradient_clipping:g}; "
            f"batch {engine.train_batch_size()} = {engine.train_micro_batch_size_per_gpu()} micro x "
            f"{engine.gradient_accumulation_steps()} accumulation x {topo.world_size} ranks "
            f"({engine.train_batch_size() * m.seq_len:,} tokens/step), {job.train.steps} steps")


def _sample(job: Job, run: Run, log: RunLog) -> str:
    """A short generated text, printed by rank 0; '' when sample_tokens is 0.

    Every rank generates (the same text, from the same seed): under ZeRO-3 each forward call
    all-gathers parameters, so rank 0 cannot run the model alone.
    """
    t = job.train
    if not t.sample_tokens:
        return ""
    if run.engine.is_pipe_parallel():  # a forward needs the whole schedule, at the training shape
        log.say("sample: none drawn in a run cut into pipeline stages; the exported model "
                "(model/model.safetensors, GPT's names) samples on one process")
        return ""
    prompt = run.tokenizer.encode_batch([t.sample_prompt.encode()])[0] or [run.tokenizer.eot_id]
    ids = generate(run.engine, prompt, t.sample_tokens, t.temperature, job.model.seq_len,
                   run.tokenizer.vocab_size)
    text = run.tokenizer.decode(ids)
    log.say(f"sample (temperature {t.temperature:g}, {t.sample_tokens} tokens):\n{'-' * 72}\n"
            f"{text}\n{'-' * 72}")
    return text
