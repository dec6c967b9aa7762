"""The local language-model run: a GPT on stdlib bytes, trained by the engine, read top to bottom.

Every rank runs `train(job)`; the engine joins the process group from RANK/WORLD_SIZE (torchrun
or Ray set them), so the same function runs on 1 process, under torchrun, or in a Ray worker.
Only rank 0 prints.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

import hybrid_ray
from hybrid_ray.engine.engine import Engine
from hybrid_ray.lm.job import Job
from hybrid_ray.lm.stdlib_bytes import (VOCAB_SIZE, ByteCorpus, ByteWindows, evenly_spaced,
                                        load_corpus, unigram_entropy)
from hybrid_ray.models import GPT, GPTConfig

Batch = Tuple[torch.Tensor, torch.Tensor]


class DidNotLearnError(RuntimeError):
    """The final validation loss is not below the unigram baseline: the model learned no context."""


@dataclass(frozen=True)
class RunResult:
    """What a run achieved (every rank returns the same numbers)."""

    steps: int
    train_loss: float  # mean over the last logging interval
    val_loss: float  # whole validation set, nats/byte
    unigram_nats: float  # baseline: entropy of the validation bytes
    train_seconds: float
    tokens_per_s: float
    sample: str


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(msg: str) -> None:
    """Print on rank 0 only, unbuffered (torchrun pipes stdout, and the log should flow)."""
    if _rank() == 0:
        print(msg, flush=True)


def set_threads() -> int:
    """Split the cores between the processes of this machine: oversubscribed ranks crawl."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return threads


def build(job: Job, corpus: ByteCorpus) -> Tuple[Engine, torch.utils.data.DataLoader]:
    """Model, engine and this rank's loader; every rank builds the same initial weights."""
    m = job.model
    torch.manual_seed(job.engine.seed or 0)
    model = GPT(GPTConfig(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model,
                          vocab_size=VOCAB_SIZE, seq_len=m.seq_len, dropout=m.dropout))
    engine, _, loader, _ = hybrid_ray.initialize(
        model, config=job.engine, training_data=ByteWindows(corpus.train, m.seq_len))
    return engine, loader


def batches(loader: torch.utils.data.DataLoader) -> Iterator[Batch]:
    """Micro-batches forever; each epoch reshuffles (the sampler's epoch seeds its permutation)."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


@torch.no_grad()
def evaluate(engine: Engine, windows: ByteWindows, count: Optional[int]) -> float:
    """Mean loss (nats/byte) over `count` evenly spaced windows (all if None), split over ranks."""
    engine.eval()
    topo = engine.topology
    mine = evenly_spaced(len(windows), count)[topo.rank::topo.world_size]
    mbs = engine.train_micro_batch_size_per_gpu()
    # (sum of per-token losses, tokens), on the device: NCCL reduces device tensors only.
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for lo in range(0, len(mine), mbs):
        x, y = (torch.stack(t) for t in zip(*(windows[i] for i in mine[lo:lo + mbs])))
        loss = engine(x.to(engine.device), y.to(engine.device))
        total[0] += loss.detach().double() * y.numel()
        total[1] += y.numel()
    engine.train()
    total = _all_sum(total)
    return float(total[0] / total[1])


@torch.no_grad()
def generate(engine: Engine, prompt: bytes, n: int, temperature: float, seq_len: int) -> bytes:
    """Sample n bytes after prompt (greedy when temperature is 0) with a fixed seed."""
    engine.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([list(prompt or b"\n")], dtype=torch.long, device=engine.device)
    for _ in range(n):
        logits = engine(idx[:, -seq_len:])[0, -1].float().cpu()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt.view(1, 1).to(idx.device)], dim=1)
    engine.train()
    return bytes(idx[0].tolist())


def _log_line(engine: Engine, step: int, total: int, loss: float, tok_s: float) -> str:
    norm = engine.get_global_grad_norm()  # None before the first optimizer step
    norm_text = "-" if norm is None else f"{norm:.3f}"
    return (f"step {step:>5}/{total} | loss {loss:.4f} | lr {engine.get_lr()[0]:.2e} | "
            f"loss scale {engine.loss_scale:g} | grad norm {norm_text} | {tok_s:,.0f} tok/s")


def train_steps(job: Job, engine: Engine, loader: torch.utils.data.DataLoader,
                val: ByteWindows) -> Tuple[float, float, float]:
    """The optimizer steps with logging and periodic evaluation.

    Returns (train loss over the last logging interval, wall seconds, training tokens/s); the
    tokens/s leave evaluation time out.
    """
    steps, every = job.train.steps, engine.config.steps_per_print
    tokens_per_step = engine.train_batch_size() * job.model.seq_len
    data = batches(loader)
    # Summed on the device and read once per log line: a float(loss) per micro-step would be a
    # host-device sync per micro-step on a GPU.
    loss_sum = torch.zeros(2, dtype=torch.float32, device=engine.device)
    last_loss, eval_seconds = float("nan"), 0.0
    start = t_log = time.perf_counter()
    for step in range(1, steps + 1):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(data)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            loss_sum[0] += loss.detach().float()
            loss_sum[1] += 1
        if step % every == 0 or step == steps:
            summed = _all_sum(loss_sum.clone())  # the mean over every rank's micro-batches
            last_loss = float(summed[0] / summed[1])
            now = time.perf_counter()
            tok_s = (step % every or every) * tokens_per_step / (now - t_log)
            say(_log_line(engine, step, steps, last_loss, tok_s))
            loss_sum.zero_()
            t_log = now
        if step % job.train.eval_interval == 0 and step != steps:
            t0 = time.perf_counter()
            val_loss = evaluate(engine, val, job.train.eval_samples)
            say(f"eval  step {step}: val loss {val_loss:.4f} "
                f"({job.train.eval_samples or 'all'} windows)")
            t_log += time.perf_counter() - t0
            eval_seconds += time.perf_counter() - t0
    seconds = time.perf_counter() - start
    return last_loss, seconds, steps * tokens_per_step / (seconds - eval_seconds)


def _header(job: Job, engine: Engine, corpus: ByteCorpus, threads: int) -> None:
    m, cfg, topo = job.model, engine.config, engine.topology
    say(f"hybrid_ray local run: {topo.world_size} process(es) on {topo.device.type} "
        f"({topo.backend if topo.is_distributed else 'no process group'}), "
        f"{threads} thread(s) each, torch {torch.__version__}, Python {sys.version.split()[0]}")
    say(f"data:   {corpus.describe()}")
    say(f"model:  GPT {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, context "
        f"{m.seq_len} bytes: {engine.module.num_params() / 1e6:.2f} M parameters")
    sched = cfg.scheduler.type if cfg.scheduler else "constant lr"
    say(f"engine: {cfg.base_dtype}, ZeRO stage {cfg.zero_optimization.stage}, {cfg.optimizer.type} "
        f"{cfg.optimizer.params}, {sched}, clip {cfg.gradient_clipping:g}; batch "
        f"{engine.train_batch_size()} = {engine.train_micro_batch_size_per_gpu()} micro x "
        f"{engine.gradient_accumulation_steps()} accumulation x {topo.world_size} ranks "
        f"({engine.train_batch_size() * m.seq_len:,} tokens/step), {job.train.steps} steps")


def train(job: Job) -> RunResult:
    """Run the whole job on this rank; every rank returns the same RunResult."""
    threads = set_threads()
    if _rank() == 0:  # the engine reports skipped steps through logging
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    corpus = load_corpus(job.train.corpus_bytes, job.train.val_fraction)
    engine, loader = build(job, corpus)
    _header(job, engine, corpus, threads)
    val = ByteWindows(corpus.val, job.model.seq_len)
    train_loss, seconds, tok_s = train_steps(job, engine, loader, val)
    val_loss, baseline = evaluate(engine, val, None), unigram_entropy(corpus.val)
    say(f"final: train loss {train_loss:.4f} | val loss {val_loss:.4f} nats/byte "
        f"(all {len(val)} windows) | unigram baseline {baseline:.4f} nats/byte | "
        f"{seconds:.0f} s training, {tok_s:,.0f} tok/s")
    text = ""
    if job.train.sample_bytes and engine.topology.rank == 0:
        out = generate(engine, job.train.sample_prompt.encode(), job.train.sample_bytes,
                       job.train.temperature, job.model.seq_len)
        text = out.decode("utf-8", errors="replace")
        say(f"sample (temperature {job.train.temperature:g}):\n{'-' * 72}\n{text}\n{'-' * 72}")
    if dist.is_available() and dist.is_initialized():
        # Ranks leave together (rank 0 is still sampling): none tears down the group early.
        dist.barrier()
    if job.train.require_below_baseline and not val_loss < baseline:
        raise DidNotLearnError(
            f"final val loss {val_loss:.4f} is not below the unigram baseline {baseline:.4f} "
            "nats/byte: the model learned nothing from context (train longer or raise the lr)")
    return RunResult(job.train.steps, train_loss, val_loss, baseline, seconds, tok_s, text)
