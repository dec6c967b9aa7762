"""Host memory a checkpoint snapshot copies into."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

Tensors = Dict[str, torch.Tensor]


class HostBuffers:
    """Host tensors a snapshot copies into, reused by the next snapshot of the same layout.

    Pinned when the state lives on a GPU: device-to-host copies into pinned memory run at full
    bus speed without a staging copy, and are issued non-blocking with one synchronisation at
    the end. Pinning gigabytes costs seconds, hence the reuse (an asynchronous save keeps its
    buffers; a synchronous one drops them). torch rounds every pinned allocation up to a power
    of two, so a group of tensors reserved together shares one allocation (rounded once).
    """

    ALIGN = 64  # bytes; every view starts aligned for any dtype

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffers: Tensors = {}
        self._groups: Dict[str, tuple] = {}  # group -> its layout, to reuse or replace it

    def reserve(self, group: str, specs: List[Tuple[str, torch.Size, torch.dtype]]) -> None:
        """Lay out (key, shape, dtype) tensors in one allocation, unless the group has this layout."""
        layout = tuple((key, tuple(shape), dtype) for key, shape, dtype in specs)
        old = self._groups.get(group)
        if old == layout:
            return
        for key, _, _ in old or ():
            self._buffers.pop(key, None)  # let the old allocation go
        offsets, total = [], 0
        for _, shape, dtype in layout:
            total = -(-total // self.ALIGN) * self.ALIGN
            offsets.append(total)
            total += torch.Size(shape).numel() * dtype.itemsize
        arena = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=self.pin)
        for (key, shape, dtype), off in zip(layout, offsets):
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            self._buffers[key] = arena[off:off + nbytes].view(dtype).view(shape)
        self._groups[group] = layout

    def copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        """`source` copied into the buffer for `key` (allocated alone if not reserved)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            buf = torch.empty(source.shape, dtype=source.dtype, pin_memory=self.pin)
            self._buffers[key] = buf
        buf.copy_(source, non_blocking=self.pin and source.is_cuda)
        return buf

    def ready(self) -> None:
        """Wait for the non-blocking copies issued so far."""
        if self.pin:
            torch.cuda.synchronize()
