"""Stages 1-2: the all-gather of updated parameters overlapped with the next forward.

Without it the step ends by waiting for every bucket's all-gather, so the communication of
half the parameter traffic is exposed (DDP's one all-reduce overlaps backward instead). With
`zero_optimization.overlap_param_gather`, the step issues the all-gathers in the order forward
uses the buckets and returns; a pre-forward hook on each module that owns parameters waits
only for the gathers up to the last bucket holding them, so the first layers compute while the
later buckets are still on the wire.

Parameters are final only where something waits: each owning module's forward, the model's
state_dict(), `engine.finish_delayed_update()` and every engine method that reads weights
(checkpoints, export, the next step). A parameter read outside those (a weight tied into
another module's forward before its own, an EMA reading `module.parameters()` right after the
step) must call `engine.finish_delayed_update()` first; that is why the option is off by default.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Sequence, Tuple

import torch.distributed as dist
import torch.nn as nn

from .flat import FlatSpace


class ParamGatherOverlap:
    """Issue order of the parameter all-gathers, the works in flight, and the hooks that wait."""

    def __init__(self, module: nn.Module, spaces: Sequence[FlatSpace]):
        registered = {id(p): i for i, p in enumerate(module.parameters())}
        first_use: List[Tuple[int, int, int]] = []
        for si, space in enumerate(spaces):
            if space.num_shards > 1 and space.local_shard is None:
                for b in space.buckets:
                    first_use.append((min(registered.get(id(p), 1 << 62) for p in b.params), si, b.index))
        first_use.sort()  # forward (registration) order: buckets hold parameters in reverse
        # (space index, bucket index) -> where its gather is issued in a step
        self.position: Dict[Tuple[int, int], int] = {(si, bi): pos for pos, (_, si, bi) in enumerate(first_use)}
        pos_of = {id(p): self.position[(si, b.index)] for si, space in enumerate(spaces)
                  for b in space.buckets if (si, b.index) in self.position for p in b.params}
        self._pending: List[dist.Work] = []
        self._next = 0
        self._handles: List[Any] = []
        for m in module.modules():
            own = [pos_of[id(p)] for p in m.parameters(recurse=False) if id(p) in pos_of]
            if own:
                self._handles.append(m.register_forward_pre_hook(partial(self._before_forward, max(own))))
        self._handles.append(module.register_state_dict_pre_hook(lambda *_a, **_k: self.settle()))

    def start(self, works: List[dist.Work]) -> None:
        """Hand over this step's gathers, in `position` order."""
        self.settle()
        self._pending, self._next = works, 0

    def _before_forward(self, last: int, _module: nn.Module, _args: Any) -> None:
        if self._pending:
            self.settle(last)

    def settle(self, last: int = -1) -> None:
        """Wait for the gathers up to position `last` (all of them: -1); gloo and NCCL finish a
        group's collectives in issue order, so waiting in order costs nothing extra."""
        end = len(self._pending) if last < 0 else min(last + 1, len(self._pending))
        while self._next < end:
            self._pending[self._next].wait()
            self._next += 1
        if self._next >= len(self._pending):
            self._pending, self._next = [], 0

    @property
    def in_flight(self) -> int:
        return len(self._pending) - self._next

    def remove(self) -> None:
        self.settle()
        for h in self._handles:
            h.remove()
        self._handles.clear()
