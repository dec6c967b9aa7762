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
from typing import Dict, Hashable, List, Tuple

import torch

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


def compress(x: torch.Tensor) -> Tuple[float, torch.Tensor]:
    """(scale, packed signs): x is sent as scale * sign(x)."""
    scale = float(x.norm()) / math.sqrt(max(1, x.numel()))
    return scale, pack_signs(x)


def decompress(scale: float, packed: torch.Tensor, numel: int) -> torch.Tensor:
    return unpack_signs(packed, numel).mul_(scale)


def payload_bytes(numel: int) -> int:
    """What one rank sends for `numel` elements at one level: the bits and an fp32 scale."""
    return (numel + 7) // 8 + 4


class SignAverage:
    """The two-level 1-bit average with worker and server residuals, per bucket key."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.worker: Dict[tuple, torch.Tensor] = {}
        self.server: Dict[tuple, torch.Tensor] = {}

    def _send(self, store: Dict, key: tuple, x: torch.Tensor) -> torch.Tensor:
        """x plus its residual, as the receiver decodes it; the remainder becomes the residual."""
        acc = x.to(torch.float32, copy=True)
        residual = store.get(key)
        if residual is not None:
            acc.add_(residual)
        scale, bits = compress(acc)
        sent = decompress(scale, bits, acc.numel())
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
        """The decoded average of one tensor per rank (what every rank ends up holding)."""
        assert len(tensors) == self.ranks
        total = torch.zeros_like(tensors[0], dtype=torch.float32)
        for r, t in enumerate(tensors):
            total.add_(self._send(self.worker, (key, r), t))
        total.div_(self.ranks)
        # Each rank serves one contiguous chunk: its scale covers only that chunk.
        chunks = total.tensor_split(self.ranks)
        return torch.cat([self._send(self.server, (key, r), c) for r, c in enumerate(chunks)])
