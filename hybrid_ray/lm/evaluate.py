"""Validation loss over held-out windows, and sampling text from the trained model."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from hybrid_ray.engine import Engine
from hybrid_ray.engine.pipe import PipelineModule

IGNORE_INDEX = -100  # cross-entropy's default: targets that score nothing


def evenly_spaced(n: int, count: Optional[int]) -> List[int]:
    """count indices spread over range(n) (all of them when count is None or >= n)."""
    if count is None or count >= n:
        return list(range(n))
    step = n / count
    return [min(n - 1, math.floor(i * step)) for i in range(count)]


def all_sum(t: torch.Tensor, engine: Engine) -> torch.Tensor:
    """Sum over the data-parallel ranks, in place (nothing to do on one rank)."""
    if engine.topology.world_size > 1 and dist.is_initialized():
        dist.all_reduce(t, group=engine.topology.group)
    return t


@torch.no_grad()
def evaluate(engine: Engine, windows: Dataset, count: Optional[int]) -> float:
    """Mean loss (nats/token) over `count` evenly spaced windows (all if None), split over ranks."""
    if isinstance(engine.module, PipelineModule):  # its forward gives logits: eval_batch scores
        return _evaluate_stages(engine, windows, count)
    engine.eval()
    topo = engine.topology
    chosen = evenly_spaced(len(windows), count)
    mine = chosen[topo.rank::topo.world_size]
    mbs = engine.train_micro_batch_size_per_gpu()
    # Every rank makes the same number of forward calls: under ZeRO-3 each call all-gathers
    # parameters, so a rank with one window fewer would leave the others waiting. A rank out
    # of windows scores a stand-in and leaves it out of the sums.
    calls = math.ceil(math.ceil(len(chosen) / topo.world_size) / mbs)
    # (sum of per-token losses, tokens), on the device: NCCL reduces device tensors only.
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for c in range(calls):
        batch = mine[c * mbs:(c + 1) * mbs]
        x, y = (torch.stack(t) for t in zip(*(windows[i] for i in batch or chosen[:1])))
        loss = engine(x.to(engine.device), y.to(engine.device))
        if batch:
            total[0] += loss.detach().double() * y.numel()
            total[1] += y.numel()
    engine.train()
    total = all_sum(total, engine)
    return float(total[0] / total[1])


def _evaluate_stages(engine: Engine, windows: Dataset, count: Optional[int]) -> float:
    """evaluate() for a PipelineModule, through eval_batch: with stages each call runs the
    schedule over gradient_accumulation_steps micro-batches of the training shape (a stage's
    buffers have that shape). A rank's last windows are padded with stand-ins whose targets
    are the loss's ignore_index, so they score nothing, and a micro-batch of stand-ins only is
    left out of the sums; every rank of a pipeline reads the same windows."""
    topo = engine.topology
    chosen = evenly_spaced(len(windows), count)
    mine = chosen[topo.rank::topo.world_size]
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    calls = math.ceil(math.ceil(len(chosen) / topo.world_size) / (mbs * gas))
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for c in range(calls):
        micro, tokens = [], []
        for m in range(gas):
            ids = mine[(c * gas + m) * mbs:(c * gas + m + 1) * mbs]
            x, y = (torch.stack(t) for t in zip(*(windows[i] for i in ids + chosen[:1] * (mbs - len(ids)))))
            y[len(ids):] = IGNORE_INDEX
            micro.append((x, y))
            tokens.append(y[:len(ids)].numel())
        losses = engine.eval_batch(iter(micro), reduce_output=None)
        for loss, n in zip(losses, tokens):
            if n:
                total[0] += loss.double() * n
                total[1] += n
    total = all_sum(total, engine)
    return float(total[0] / total[1])


@torch.no_grad()
def generate(engine: Engine, prompt: Sequence[int], n: int, temperature: float, seq_len: int,
             vocab_size: int) -> List[int]:
    """n tokens after prompt (greedy when temperature is 0), seeded; padding ids never drawn."""
    engine.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=engine.device)
    # Under tensor parallelism the model splits the sequence over the ranks: the context is
    # padded on the right to a multiple of their number, which a causal model never reads
    # back into the positions before it.
    split = max(1, getattr(engine, "tp_world_size", 1))
    for _ in range(n):
        context = idx[:, -seq_len:]
        last = context.shape[1] - 1
        pad = -context.shape[1] % split
        if pad:
            context = torch.cat([context, context[:, -1:].expand(1, pad)], dim=1)
        logits = engine(context)[0, last, :vocab_size].float().cpu()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=g)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt.view(1, 1).to(idx.device)], dim=1)
    engine.train()
    return idx[0].tolist()
