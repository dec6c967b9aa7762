"""An LM job's model trained with W data-parallel ranks simulated in one process.

What the compression quality study (jobs/compression_quality.py) needs from the LM job: its
model, data windows, optimizer, scheduler and evaluation, with each rank's micro-batch
gradient computed one rank after the other, so that what the reduction does to the
gradients can be varied without processes, Ray or a process group.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import torch

from hybrid_ray.data import ensure_prepared, open_split
from hybrid_ray.engine.precision import is_norm
from hybrid_ray.engine.schedulers import build_scheduler
from hybrid_ray.lm.evaluate import evenly_spaced
from hybrid_ray.lm.job import Job
from hybrid_ray.lm.setup import build_model


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


class Windows:
    """Training windows in a seeded random order, each seen once per pass."""

    def __init__(self, count: int, seed: int, allow_repeat: bool, need: int):
        if need > count and not allow_repeat:
            raise SystemExit(f"the run needs {need:,} training windows, the corpus has {count:,}: it "
                             "would see text twice; use a larger corpus (data.corpus.max_bytes, "
                             "data.corpus.sources) or pass --allow-repeat")
        self.count, self.gen, self.passes = count, torch.Generator().manual_seed(seed), 0
        self._order, self._pos = torch.empty(0, dtype=torch.long), 0

    def take(self, n: int) -> torch.Tensor:
        if self._pos + n > self._order.numel():
            self._order, self._pos = torch.randperm(self.count, generator=self.gen), 0
            self.passes += 1
        out = self._order[self._pos:self._pos + n]
        self._pos += n
        return out


def start(job: Job, steps: int, seed: int, ranks: int, data, allow_repeat: bool):
    """(model, optimizer, scheduler, buckets, windows) of a fresh run, as the job builds them."""
    train, _, vocab_size = data
    e = job.engine
    model = build_model(job, vocab_size, seed).to(train.device)
    opt = getattr(torch.optim, e.optimizer.type)(model.parameters(), **e.optimizer.params)
    sched = build_scheduler(with_total(e.scheduler, steps), opt)
    windows = Windows(train.shape[0], seed, allow_repeat, steps * e.train_micro_batch_size_per_gpu * ranks)
    return model, opt, sched, buckets_of(model), windows


def rank_batches(job: Job, train: torch.Tensor, windows: Windows, ranks: int):
    micro = job.engine.train_micro_batch_size_per_gpu
    idx = windows.take(micro * ranks).to(train.device)
    return [train[idx[r * micro:(r + 1) * micro]] for r in range(ranks)]


def bucket_grads(model, buckets, batch: torch.Tensor) -> List[torch.Tensor]:
    """This batch's gradient, one flat fp32 tensor per bucket."""
    model.zero_grad(set_to_none=True)
    model(batch[:, :-1], batch[:, 1:]).backward()
    return [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in buckets]


def set_grads(buckets, flats: List[torch.Tensor]) -> None:
    for bucket, flat in zip(buckets, flats):
        off = 0
        for p in bucket:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()


def with_total(sched_cfg, steps: int):
    """The job's scheduler stretched over `steps` when it has a total (a longer study run)."""
    if sched_cfg is None or getattr(sched_cfg.params, "total_num_steps", None) is None:
        return sched_cfg
    return replace(sched_cfg, params=replace(sched_cfg.params, total_num_steps=steps))


@torch.no_grad()
def val_loss(model, val: torch.Tensor, count: Optional[int], micro: int) -> float:
    """Mean loss over the same evenly spaced windows the job evaluates."""
    model.eval()
    chosen = torch.tensor(evenly_spaced(val.shape[0], count), device=val.device)
    total = 0.0
    for lo in range(0, chosen.numel(), micro):
        batch = val[chosen[lo:lo + micro]]
        total += model(batch[:, :-1], batch[:, 1:]).item() * batch.shape[0]
    return total / chosen.numel()
