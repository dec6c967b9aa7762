"""Page-locked host buffers of exactly the size asked for.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds
every block up to a power of two: the fp32 masters of a 1.3B model (5.3 GB in one flat shard)
took an 8 GB pinned block, and the bf16 staging copy of the same shard 4 GB more. Persistent
buffers are instead plain host allocations registered with the driver (cudaHostRegister, as
torch.distributed.checkpoint's stager does): page-locked, so copies from and to them are
asynchronous, and exactly as large as the tensor.

Registered memory must be unregistered before it is freed, so the registry keeps each buffer
alive until `release()` (engine close, or the registry's own collection). A tensor used after
that is still valid host memory, only no longer page-locked: its copies become synchronous.
"""
from __future__ import annotations

import logging
from typing import Dict

import torch

log = logging.getLogger("hybrid_ray")

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


def register(t: torch.Tensor) -> int:
    """Page-lock the host memory under `t` (plain or mapped); the cudaError (0: done)."""
    return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), _PORTABLE))


def unregister(ptr: int) -> None:
    """Undo `register` (after the copies that read or write the memory)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        log.warning("cudaHostUnregister failed (cudaError %d)", err)


class PinnedRegistry:
    """Hands out registered (page-locked) host tensors and unregisters them on release."""

    def __init__(self) -> None:
        self._held: Dict[int, torch.Tensor] = {}
        self.failed = False  # registration refused once (locked-memory limit): plain memory from then on

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device="cpu")
        if numel == 0 or self.failed:
            return out
        nbytes = out.numel() * out.element_size()
        err = register(out)
        if err != 0:
            self.failed = True
            log.warning("offload: registering %.1f GB of host memory as page-locked failed (cudaError "
                        "%d; the locked-memory limit?): host buffers stay pageable and their copies "
                        "synchronous", nbytes / 1e9, err)
            return out
        self._held[out.data_ptr()] = out
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held.values())

    def release(self) -> None:
        """Unregister every buffer (after the copies that read them: the caller synchronizes)."""
        held, self._held = self._held, {}
        for ptr in held:
            unregister(ptr)

    def __del__(self) -> None:
        try:
            if self._held:
                self.release()
        except Exception:  # interpreter shutdown: the CUDA runtime may be gone already
            pass
