"""How top-k's (index, value) pairs travel: a fixed-size byte payload per rank and bucket.

Values: fp32 (4 bytes), bf16 (2) or int8 with one fp32 scale per 256 values (1 + 1/64). What a
rounding loses goes into the sender's error-feedback residual like any unsent part (topk.py), so
nothing is lost, only delayed. Indices: int32 (4 bytes), or block16: sorted, as 16-bit offsets
within blocks of 65,536 elements plus one int32 count per block (2 bytes + 4 per 64K elements).
At top-k's sizes int8 + block16 is 3 bytes per kept element against 8.

The size depends only on (k, bucket size), the same on every rank, so the payloads still travel
in one all_gather (gloo and NCCL have no variable-size one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch

BLOCK = 1 << 16  # block16: elements per index block
CHUNK = 256  # int8: values per scale
VALUE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class PairCodec:
    values: str = "fp32"  # fp32 | bf16 | int8
    indices: str = "int32"  # int32 | block16

    @property
    def sorted(self) -> bool:
        """block16 needs the indices in ascending order."""
        return self.indices == "block16"

    def nbytes(self, k: int, numel: int) -> int:
        """Payload bytes for k pairs of a bucket of `numel` elements."""
        out = k * VALUE_BYTES[self.values]
        if self.values == "int8":
            out += 4 * math.ceil(k / CHUNK)
        return out + (4 * k if self.indices == "int32" else 2 * k + 4 * math.ceil(numel / BLOCK))

    def encode(self, idx: torch.Tensor, values: torch.Tensor, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(payload as uint8, the values as every receiver will decode them). `idx` ascending
        when `sorted`; `values` fp32."""
        parts: List[torch.Tensor] = []
        if self.values == "fp32":
            sent = values
            parts.append(values)
        elif self.values == "bf16":
            half = values.to(torch.bfloat16)
            sent = half.float()
            parts.append(half)
        else:
            q, scales = _int8(values)
            sent = _dequant(q, scales, values.numel())
            parts += [scales, q]
        if self.indices == "int32":
            parts.append(idx.to(torch.int32))
        else:
            counts = torch.bincount(idx.long() // BLOCK, minlength=math.ceil(numel / BLOCK)).to(torch.int32)
            parts += [counts, ((idx.long() % BLOCK) - 32768).to(torch.int16)]
        payload = torch.cat([p.contiguous().view(torch.uint8) for p in parts])
        return payload, sent

    def decode(self, payload: torch.Tensor, k: int, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(int64 indices, fp32 values) of one rank's payload."""
        cursor = [0]

        def take(count: int, dtype: torch.dtype) -> torch.Tensor:
            size = count * torch.tensor([], dtype=dtype).element_size()
            part = payload[cursor[0]:cursor[0] + size].clone().view(dtype)  # clone: aligned storage
            cursor[0] += size
            return part
        if self.values == "fp32":
            values = take(k, torch.float32)
        elif self.values == "bf16":
            values = take(k, torch.bfloat16).float()
        else:
            scales = take(math.ceil(k / CHUNK), torch.float32)
            values = _dequant(take(k, torch.int8), scales, k)
        if self.indices == "int32":
            return take(k, torch.int32).long(), values
        counts = take(math.ceil(numel / BLOCK), torch.int32).long()
        offsets = take(k, torch.int16).long() + 32768
        blocks = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        return blocks * BLOCK + offsets, values


def _int8(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per chunk of CHUNK values: (int8 values, fp32 scale per chunk)."""
    k = values.numel()
    padded = torch.zeros(math.ceil(k / CHUNK) * CHUNK, dtype=torch.float32, device=values.device)
    padded[:k] = values
    chunks = padded.view(-1, CHUNK)
    scales = chunks.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(chunks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:k], scales


def _dequant(q: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    return (q.float().view(-1)[:k] * torch.repeat_interleave(scales, CHUNK)[:k])
