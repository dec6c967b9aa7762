"""One bit per element with error feedback: the compressed average of 1-bit Adam.

1-bit Adam (Tang et al., 2021; DeepSpeed's OnebitAdam) runs Adam for a warm-up, then freezes
the variance and exchanges each rank's *momentum* instead of its gradient: the variance is what
makes Adam non-linear in the gradient, and once it is frozen the update is linear in the
momentum, so error feedback on a 1-bit momentum converges like the uncompressed run.

The exchange is a two-level average, both levels with error feedback:
  worker  each rank adds its residual to its momentum and sends sign bits and one scale,
          `||x||_2 / sqrt(n)` (the scale that keeps the sent vector's norm), keeping the rest;
  server  each rank owns 1/W of the elements, averages the W decoded chunks it received, adds
          its own residual and sends the average back the same way (1 bit and one scale).
Every rank decodes the same averaged momentum. Each rank sends n/8 bytes at each level, 32x
fewer than fp32 values along the same reduce-scatter/all-gather path.

With ZeRO the optimizer state is sharded, so no rank holds a whole momentum to send. The form
that fits is the worker level alone, on *gradients*: each rank sends every shard owner the
owner's chunk of its gradient plus residual, at one bit and one scale per chunk, and the owner
averages the decoded chunks; the owner then applies the momentum and the frozen-variance update
to its shard, and the parameters are all-gathered as always. With the variance frozen, the
update is linear in the gradient, so error feedback on the gradient is enough (the argument
of the paper, applied one step earlier). `SignAverage.reduce` is that exchange.

Both compute the exchange for W tensors held in one process (the quality study simulates ranks
one after the other); the bit packing is the real wire format.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .base import BucketKey, ErrorFeedback, Layout, dense_exchange, host_copies

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element (1: x >= 0), eight to a byte, zero-padded to a whole byte."""
    bits = (x.reshape(-1) >= 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """+1.0 / -1.0 per element, from `pack_signs`' bytes."""
    bits = packed.view(-1, 1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:numel].to(torch.float32).mul_(2).sub_(1)


def compress(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale as a one-element fp32 tensor, packed signs): x is sent as scale * sign(x)."""
    scale = (x.float().norm() / math.sqrt(max(1, x.numel()))).reshape(1)
    return scale, pack_signs(x)


def decompress(scale: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
    return unpack_signs(packed, numel).mul_(scale)


def encode(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(wire bytes: the fp32 scale then the bits, what the receiver decodes)."""
    scale, bits = compress(x)
    return torch.cat([scale.view(torch.uint8), bits]), decompress(scale, bits, x.numel())


def decode(payload: torch.Tensor, numel: int) -> torch.Tensor:
    scale = payload[:4].clone().view(torch.float32)  # a copy: the slice may be misaligned
    return decompress(scale, payload[4:4 + (numel + 7) // 8], numel)


def payload_bytes(numel: int, block: int = 0) -> int:
    """What one rank sends for `numel` elements at one level: the bits and an fp32 scale (one
    per `block` elements when block > 0)."""
    return (numel + 7) // 8 + 4 * (-(-numel // block) if 0 < block < numel else 1)


def encode_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the receiver decodes of x sent as signs with one scale per `block` elements (the
    study's finer-scaled variant; block <= 0: one scale for all of x, as `encode`)."""
    n = x.numel()
    if not 0 < block < n:
        return encode(x)[1]
    pad = (-n) % block
    rows = torch.cat([x.reshape(-1).float(), x.new_zeros(pad, dtype=torch.float32)]).view(-1, block)
    counts = torch.full((rows.shape[0],), float(block), device=x.device)
    counts[-1] = block - pad  # the padding zeros are not elements: the last block's own RMS
    scales = rows.norm(dim=1) / counts.sqrt()
    return torch.where(rows >= 0, 1.0, -1.0).mul_(scales[:, None]).reshape(-1)[:n]


class SignAverage:
    """The two-level 1-bit average with worker and server residuals, per bucket key."""

    def __init__(self, ranks: int, block: int = 0):
        self.ranks, self.block = ranks, block  # block > 0: a scale per `block` elements
        self.worker: Dict[tuple, torch.Tensor] = {}
        self.server: Dict[tuple, torch.Tensor] = {}

    def _send(self, store: Dict, key: tuple, x: torch.Tensor) -> torch.Tensor:
        """x plus its residual, as the receiver decodes it; the remainder becomes the residual."""
        acc = x.to(torch.float32, copy=True)
        residual = store.get(key)
        if residual is not None:
            acc.add_(residual)
        sent = encode_blocks(acc, self.block)
        store[key] = acc.sub_(sent)
        return sent

    def reduce(self, key: Hashable, tensors: List[torch.Tensor]) -> torch.Tensor:
        """The decoded average of one tensor per rank, each rank's chunk for owner j sent with its
        own scale (ZeRO form: the worker level alone)."""
        assert len(tensors) == self.ranks
        total = torch.zeros_like(tensors[0], dtype=torch.float32)
        for r, t in enumerate(tensors):
            chunks = t.tensor_split(self.ranks)
            total.add_(torch.cat([self._send(self.worker, (key, r, j), c) for j, c in enumerate(chunks)]))
        return total.div_(self.ranks)

    def average(self, key: Hashable, tensors: List[torch.Tensor]) -> torch.Tensor:
        """The decoded average of one tensor per rank (what every rank ends up holding): the
        worker level as `reduce` (a scale per owner's chunk, as the engine's momentum form
        sends it), then each owner's averaged chunk sent back at one bit with its own residual."""
        chunks = self.reduce(key, tensors).tensor_split(self.ranks)
        return torch.cat([self._send(self.server, (key, r), c) for r, c in enumerate(chunks)])


class OneBit(ErrorFeedback):
    """The engine's 1-bit exchange: dense for `warmup_steps`, then sign bits with error feedback.

    From the first compressed step on the optimizer must run with its variance frozen
    (`freezes_variance`; zero/optimizer.py): Adam's variance of sign-compressed gradients would
    be the same number everywhere. At ZeRO stages 1-3 each rank keeps an equal slice of the
    bucket: every rank sends each owner that owner's slice (one all_to_all, n/8 bytes out per
    rank) and the owner sums the decoded slices. At stage 0 every rank needs the whole sum:
    the owner of each 1/W of the bucket then sends its decoded sum back at one bit too (its own
    residual), in one all_gather, as 1-bit Adam's compressed all-reduce does.
    """

    def __init__(self, warmup_steps: int, error_feedback: bool = True, update_bound: bool = True):
        super().__init__(warmup_steps, error_feedback)
        self.server: Dict[BucketKey, torch.Tensor] = {}  # stage 0: residuals of the served chunk
        self.update_bound = update_bound  # the frozen step's (zero/frozen.py `bound`)

    @property
    def freezes_variance(self) -> bool:
        return self.step >= self.warmup_steps

    def residual_stores(self) -> Tuple[Dict[Any, torch.Tensor], ...]:
        return (self.residuals, self.server)

    def on_step(self, overflow: bool, scale_ratio: float) -> None:
        counted = self.step
        super().on_step(overflow, scale_ratio)
        if overflow and counted < self.warmup_steps:
            self.step = counted  # a skipped warm-up step estimated no variance

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "server": host_copies(self.server)}

    def load_state_dict(self, state: Dict[str, Any], device: torch.device) -> None:
        super().load_state_dict(state, device)
        self.server = {k: v.to(device) for k, v in state.get("server", {}).items()}

    def exchange(self, key: BucketKey, grad: torch.Tensor, lo: int, hi: int,
                 group: Optional[dist.ProcessGroup], layout: Optional[Layout] = None
                 ) -> Tuple[int, Callable[[], torch.Tensor]]:
        """Start one bucket's exchange; finish() returns the fp32 sum over ranks of [lo, hi)."""
        with self.timer.span("compress"):
            acc = self.with_residual(key, grad)
        if self.step < self.warmup_steps:
            return dense_exchange(acc, lo, hi, group, self.timer)
        whole = hi - lo == acc.numel()  # stage 0: every rank reduces the whole bucket
        bounds = owner_bounds(acc.numel(), lo, hi, group)
        recv, send, work = self._to_owners(key, acc, bounds, group)

        def finish() -> torch.Tensor:
            _ = send  # held until the collective is done, whatever the backend's work keeps
            self.timer.wait(work)
            with self.timer.span("compress"):
                total = owner_sum(recv, bounds, dist.get_rank(group))
            if not whole:
                return total
            return self._serve(key, total, bounds, group)[lo:hi]
        # Bytes handed to collectives, as the dense reduction counts its input (stage 0: the
        # served chunk's all_gather too).
        return send.numel() + (row_width(bounds) if whole else 0), finish

    def _to_owners(self, key: BucketKey, x: torch.Tensor, bounds: List[Tuple[int, int]],
                   group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor, Any]:
        """Worker level: every owner's chunk of x at one bit and one scale, in one all_to_all;
        what one bit could not say stays in x, this bucket's residual. (recv, send, work): the
        send buffer must be held until the collective is done."""
        with self.timer.span("compress"):
            payloads = []
            for a, b in bounds:
                payload, sent = encode(x[a:b])
                x[a:b].sub_(sent)
                payloads.append(payload)
            if self.error_feedback:
                self.residuals[key] = x
        me = dist.get_rank(group)
        mine = payload_bytes(bounds[me][1] - bounds[me][0])
        recv = torch.empty(len(bounds) * mine, dtype=torch.uint8, device=x.device)
        send = torch.cat(payloads)
        work = dist.all_to_all_single(recv, send, [mine] * len(bounds), [p.numel() for p in payloads],
                                      group=group, async_op=True)
        return recv, send, work

    def _serve(self, key: BucketKey, total: torch.Tensor, bounds: List[Tuple[int, int]],
               group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """Stage 0: this rank's summed chunk sent to all at one bit; the whole decoded sum."""
        rows, work = self._broadcast(key, total, bounds, group)
        self.timer.wait(work)
        with self.timer.span("compress"):
            return decode_rows(rows, bounds)

    def _broadcast(self, key: BucketKey, total: torch.Tensor, bounds: List[Tuple[int, int]],
                   group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, Any]:
        """Server level: this owner's chunk `total` (a tensor it owns) plus its server residual,
        sent to every rank at one bit in one all_gather; the rest stays as the residual.
        (rows, one per owner as every rank will hold them, the all_gather's work)."""
        with self.timer.span("compress"):
            residual = self.server.get(key)
            if residual is not None:
                total.add_(residual)
            payload, sent = encode(total)
            if self.error_feedback:
                self.server[key] = total.sub_(sent)
            width = row_width(bounds)
            padded = torch.zeros(width, dtype=torch.uint8, device=total.device)
            padded[:payload.numel()] = payload
        rows = torch.empty(len(bounds) * width, dtype=torch.uint8, device=total.device)
        return rows.view(len(bounds), width), comm.all_gather(rows, padded, group=group, async_op=True)


def owner_sum(recv: torch.Tensor, bounds: List[Tuple[int, int]], me: int) -> torch.Tensor:
    """What owner `me` received at the worker level (one payload per rank), decoded and summed."""
    a, b = bounds[me]
    return sum(decode(row, b - a) for row in recv.view(len(bounds), payload_bytes(b - a)))


def row_width(bounds: List[Tuple[int, int]]) -> int:
    """Bytes per served row: the largest chunk's payload, rounded up to whole fp32 words so that
    each row's leading scale can be read (and rescaled) in place."""
    return -(-payload_bytes(max(b - a for a, b in bounds)) // 4) * 4


def decode_rows(rows: torch.Tensor, bounds: List[Tuple[int, int]], lo: int = 0,
                hi: Optional[int] = None) -> torch.Tensor:
    """Elements [lo, hi) of the tensor the served rows encode (only the rows that cover them)."""
    hi = bounds[-1][1] if hi is None else hi
    parts = [decode(row, b - a)[max(lo, a) - a:min(hi, b) - a]
             for row, (a, b) in zip(rows, bounds) if a < hi and b > lo]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def owner_bounds(numel: int, lo: int, hi: int, group: Optional[dist.ProcessGroup]) -> List[Tuple[int, int]]:
    """Each owner's chunk of a bucket whose reduced [lo, hi) this rank keeps: the whole bucket
    (stage 0) or its equal ZeRO slice, else a one-line ValueError."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    bounds = _bounds(numel, world)
    if hi - lo != numel and bounds[me] != (lo, hi):
        raise ValueError(f"onebit: rank {me} keeps [{lo}, {hi}) of a {numel}-element bucket, "
                         f"expected the equal slice {bounds[me]}")
    return bounds


def _bounds(numel: int, world: int) -> List[Tuple[int, int]]:
    """Each rank's [begin, end) of a bucket: the engine's equal ZeRO slices (buckets are padded
    to a multiple of the world size), or near-equal chunks of an unpadded stage-0 bucket."""
    edges = [numel * r // world for r in range(world + 1)]
    return list(zip(edges[:-1], edges[1:]))
