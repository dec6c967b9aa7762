"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., NeurIPS 2019).

For one bucket every rank:
  1. adds its fp32 residual to the bucket's gradient (error feedback): D = g + e;
  2. views each compressible parameter's slice of D as a matrix M (n x m) and computes
     P = M Q with a Q (m x r) that every rank holds identically;
  3. sums the P's over ranks in one all-reduce, packed behind the entries reduced densely;
  4. orthonormalises each summed P (QR), computes its own Q_w = M^T P^ and keeps the residual
     e = M - P^ Q_w^T; sums the Q_w's in a second all-reduce;
  5. decompresses its part of the sum, P^ Q^T = sum_w P^ Q_w^T, into its master gradient (the
     whole bucket at stage 0, its shard slice at stages 1-3: only the rows it keeps are formed).

Matrices, per parameter (as the paper and torch's powerSGD_hook do), not per bucket: a flat
bucket is a concatenation of unrelated parameters and has no low-rank structure to exploit,
while a weight's gradient is a sum over the batch of outer products and is close to low rank.
Tensors with more than two dims are viewed as (shape[0], rest) (a conv: output channels x the
rest). 1-D tensors (biases, norm scales) and matrices whose rank-r factors would not at least
halve their bytes ((n + m) r > n m / 2) are reduced densely, in the same collective as the P's:
they are small, and low rank would save little there while still losing accuracy.

Error feedback uses the rank's own Q_w (the paper's e = D - decompress(compress(D))), not
torch's `D_w - mean(P^ Q^T)`: here e_w is the part of D_w outside span(P^), so per rank
`sent + residual == gradient + old residual` exactly, the residuals sum to what the reduction
left out, and each is a projection (bounded). torch's residuals also keep D_w - D_v, which is
never sent and grows like a random walk (it only cancels in the sum). Cost: one more n*m*r
matmul per matrix.

Warm start (torch's default): each reduction reuses the bucket's previous summed Q, so every
step is one more step of subspace iteration and the approximation improves over steps. Unlike
torch, the kept Q is orthonormalised first (same span, one m x r QR): a raw Q's columns scale
with the previous gradient's singular values, so P = M Q would be conditioned like M squared
and lose the weak directions to fp32 rounding. The first Q is a seeded Gaussian, identical on
every rank without communication (seed from the bucket key and the matrix index). An overflow
drops the kept Q's (they may hold inf/NaN).

Warm-up: the first `warmup_steps` optimizer steps reduce densely (torch's
start_powerSGD_iter): early gradients change fast and no subspace has settled yet.

Exact at full rank: with r = min(n, m) the orthonormal Q (m x m) or P^ (n x n) spans the whole
space, so the reduced sum is the dense sum up to rounding (what the tests compare against; the
default min_compression routes such matrices to the dense part anyway). Below full rank it is
an approximation even when r reaches the summed gradient's rank: rounding leaves a residual
whose directions then compete for the r columns, and error feedback keeps the running sum
right, not each step.
Memory: like topk, the residual is one fp32 bucket per rank and bucket, a whole gradient copy
at stages 2 and 3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .base import BucketKey, ErrorFeedback, Layout, dense_exchange, host_copies



@dataclass(frozen=True)
class _Matrix:
    offset: int  # bucket-relative start of the parameter
    rows: int
    cols: int
    rank: int


class _Plan:
    """How one bucket splits into matrices and densely reduced entries, for a slice [lo, hi)."""

    def __init__(self, layout: Layout, rank: int, lo: int, hi: int, device: torch.device,
                 min_compression: float):
        self.mats: List[_Matrix] = []
        dense: List[torch.Tensor] = []
        for offset, shape in sorted(layout, key=lambda item: item[0]):
            numel = math.prod(shape)
            if len(shape) >= 2 and numel > 0:
                n = shape[0]
                m = numel // n
                r = min(rank, n, m)
                if (n + m) * r * min_compression <= n * m:
                    self.mats.append(_Matrix(offset, n, m, r))
                    continue
            dense.append(torch.arange(offset, offset + numel))
        index = torch.cat(dense) if dense else torch.empty(0, dtype=torch.long)
        mine = (index >= lo) & (index < hi)
        self.dense_index = index.to(device)
        self.dense_mine = mine.nonzero().squeeze(1).to(device)  # positions in the dense part
        self.dense_out = (index[mine] - lo).to(device)  # ... and where they land in [lo, hi)
        self.p_numel = sum(x.rows * x.rank for x in self.mats)
        self.q_numel = sum(x.cols * x.rank for x in self.mats)


class PowerSGD(ErrorFeedback):
    """Rank-r PowerSGD with error feedback, warm start and a dense warm-up."""

    # Compress a matrix only when its factors take at most 1/min_compression of its size
    # (torch's default, 2). Tests set 0 to run the low-rank path at full rank, where it is exact.
    min_compression: float = 2.0

    def __init__(self, rank: int, warmup_steps: int = 0, error_feedback: bool = True,
                 warm_start: bool = True, seed: int = 0):
        super().__init__(warmup_steps, error_feedback)
        self.rank, self.warm_start, self.seed = rank, warm_start, seed
        self._plans: Dict[Tuple[BucketKey, int, int], _Plan] = {}
        self._q: Dict[Tuple[BucketKey, int], torch.Tensor] = {}
        self._draws: Dict[Tuple[BucketKey, int], int] = {}

    def on_step(self, overflow: bool, scale_ratio: float) -> None:
        super().on_step(overflow, scale_ratio)
        if overflow:
            self._q.clear()  # Q's are scale-free, so a new loss scale needs nothing else

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "q": host_copies(self._q), "draws": dict(self._draws)}

    def load_state_dict(self, state: Dict[str, Any], device: torch.device) -> None:
        super().load_state_dict(state, device)
        self._q = {k: v.to(device) for k, v in state["q"].items()}
        self._draws = dict(state["draws"])

    def exchange(self, key: BucketKey, grad: torch.Tensor, lo: int, hi: int,
                 group: Optional[dist.ProcessGroup], layout: Optional[Layout] = None
                 ) -> Tuple[int, Callable[[], torch.Tensor]]:
        """Start the P all-reduce of one bucket; finish() runs the Q round and returns the
        fp32 sum over ranks of the bucket's entries [lo, hi) (bucket-relative).

        `layout` lists (bucket-relative offset, shape) per parameter; without it (or during
        the warm-up, or with nothing worth compressing) the bucket is all-reduced densely.
        """
        with self.timer.span("compress"):
            acc = self.with_residual(key, grad)  # D = g + e
        dense = layout is None or self.step < self.warmup_steps
        plan = None if dense else self._plan(key, layout, lo, hi, acc.device)
        if plan is None or not plan.mats:
            return dense_exchange(acc, lo, hi, group, self.timer)
        with self.timer.span("compress"):
            nd = plan.dense_index.numel()
            buf = torch.empty(nd + plan.p_numel, dtype=torch.float32, device=acc.device)
            torch.index_select(acc, 0, plan.dense_index, out=buf[:nd])
            ms, ps = [], []
            cursor = nd
            for i, mat in enumerate(plan.mats):
                ms.append(acc[mat.offset:mat.offset + mat.rows * mat.cols].view(mat.rows, mat.cols))
                ps.append(buf[cursor:cursor + mat.rows * mat.rank].view(mat.rows, mat.rank))
                torch.mm(ms[-1], self._initial_q(key, i, mat, acc.device), out=ps[-1])
                cursor += mat.rows * mat.rank
        work = dist.all_reduce(buf, group=group, async_op=True)

        def finish() -> torch.Tensor:
            self.timer.wait(work)
            with self.timer.span("compress"):
                phats, qbuf, qs = self._project(plan, ms, ps, acc.device)
            second = dist.all_reduce(qbuf, group=group, async_op=True)
            self.timer.wait(second)
            with self.timer.span("compress"):
                if self.error_feedback:
                    acc.index_fill_(0, plan.dense_index, 0.0)  # sent whole: nothing held back
                    self.residuals[key] = acc
                if self.warm_start:  # orthonormal: P = M Q then has M's conditioning, not its square
                    for i, q in enumerate(qs):
                        self._q[(key, i)] = torch.linalg.qr(q).Q
                return self._decompress(plan, buf[:nd], phats, qs, lo, hi)
        return (buf.numel() + plan.q_numel) * 4, finish

    # ---- the pieces ----------------------------------------------------------------------
    def _plan(self, key: BucketKey, layout: Layout, lo: int, hi: int, device: torch.device) -> _Plan:
        plan = self._plans.get((key, lo, hi))
        if plan is None:
            plan = self._plans[(key, lo, hi)] = _Plan(layout, self.rank, lo, hi, device,
                                                                 self.min_compression)
        return plan

    def _initial_q(self, key: BucketKey, i: int, mat: _Matrix, device: torch.device) -> torch.Tensor:
        """The previous summed Q (warm start), else a Gaussian drawn alike on every rank."""
        q = self._q.get((key, i))
        if q is not None and q.shape == (mat.cols, mat.rank):
            return q
        draw = self._draws.get((key, i), 0)
        self._draws[(key, i)] = draw + 1
        seed = self.seed + 1_000_003 * key[0] + 10_007 * key[1] + 101 * i + 7 * draw
        g = torch.Generator().manual_seed(seed)
        return torch.randn(mat.cols, mat.rank, generator=g).to(device)

    def _project(self, plan: _Plan, ms: List[torch.Tensor], ps: List[torch.Tensor],
                 device: torch.device) -> Tuple[List[torch.Tensor], torch.Tensor, List[torch.Tensor]]:
        """Orthonormal P^ per matrix, this rank's Q_w = M^T P^ (packed), residual M -= P^ Q_w^T."""
        qbuf = torch.empty(plan.q_numel, dtype=torch.float32, device=device)
        phats, qs, cursor = [], [], 0
        for mat, m, p in zip(plan.mats, ms, ps):
            # Householder QR: orthonormal columns even when P is rank-deficient (a gradient of
            # rank < r), where Gram-Schmidt would normalise rounding noise.
            phat = torch.linalg.qr(p).Q
            q = qbuf[cursor:cursor + mat.cols * mat.rank].view(mat.cols, mat.rank)
            torch.mm(m.t(), phat, out=q)
            if self.error_feedback:
                m.addmm_(phat, q.t(), alpha=-1.0)  # before the all-reduce sums q in place
            phats.append(phat)
            qs.append(q)
            cursor += mat.cols * mat.rank
        return phats, qbuf, qs

    @staticmethod
    def _decompress(plan: _Plan, dense: torch.Tensor, phats: List[torch.Tensor],
                    qs: List[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Entries [lo, hi) of the summed bucket: dense ones copied, matrix rows P^ Q^T formed."""
        out = torch.zeros(hi - lo, dtype=torch.float32, device=dense.device)
        out.index_copy_(0, plan.dense_out, dense.index_select(0, plan.dense_mine))
        for mat, phat, q in zip(plan.mats, phats, qs):
            a, b = max(mat.offset, lo), min(mat.offset + mat.rows * mat.cols, hi)
            if a >= b:
                continue
            r0, r1 = (a - mat.offset) // mat.cols, -(-(b - mat.offset) // mat.cols)
            rows = torch.mm(phat[r0:r1], q.t()).view(-1)
            start = a - mat.offset - r0 * mat.cols
            out[a - lo:b - lo] = rows[start:start + b - a]
        return out

