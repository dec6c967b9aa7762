"""ZeRO stage 3: parameters partitioned too, gathered just in time, released after use.

Units. The model is cut into units gathered and released together: by default every child of
every `nn.ModuleList` (a transformer's blocks). Everything else, parameters shared between units
(a GPT's embedding tied to its output head) and parameters registered with
`register_external_parameter` form the root unit, gathered for the whole forward and backward.
Parameters smaller than `stage3_param_persistence_threshold` are not partitioned at all: they
are kept whole on every rank and treated like stage 2 (no per-use collective for a LayerNorm).

Storage. Each space keeps one flat buffer object for its whole life. Gathering gives its storage
the space's bytes, all-gathers every rank's shard into it and points the parameters' `.data` at
views of it; releasing points them at an empty tensor and shrinks the storage to zero bytes.
Why the storage and not a fresh buffer each time: autograd saves views of the weights (a
linear layer keeps `weight.t()`, a tensor-parallel module a DTensor over its shard), and a view
keeps its storage alive. With a fresh buffer per gather, every unit's parameters stayed whole
from its forward to its backward; with one storage resized in place (as FSDP2 does) the bytes
go at release, and the saved views read the re-gathered values in backward. Between uses a rank
holds only its shard (the half-precision copy that the optimizer writes back into) plus its
fp32 master shard.

Schedule. A unit is gathered in its forward pre-hook and released in its forward post-hook;
forward hooks on its outputs gather it again just before its backward; it is released once all
its parameters' gradients have been reduced. The order of units seen in the first forward is
recorded; later, gathering unit k also starts the all-gather of the next unit(s) in forward (or
backward) order, up to `stage3_prefetch_bucket_size` elements, so communication overlaps compute.
With one rank there is nothing to gather: the engine then runs stage 3 as stage 2.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterable, Iterator, List, Optional, Set

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from . import partition
from .flat import FlatSpace
from .gathered import Stage3Params
from ..topology import Topology

EXTERNAL_ATTR = "_hybrid_ray_external_params"


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `param`, which another module owns (ZeRO-3).

    Such parameters join the root unit, which stays gathered for the whole forward and
    backward; without this, reading a released parameter fails on its empty storage.
    """
    getattr(module, EXTERNAL_ATTR, None) or setattr(module, EXTERNAL_ATTR, [])
    getattr(module, EXTERNAL_ATTR).append(param)


def unit_modules(model: nn.Module) -> List[nn.Module]:
    """Default units: the children of every ModuleList, else the root's direct children, a
    ModuleDict's members in its place (a container is never called itself, so hooks on it
    would never gather its parameters)."""
    units = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    if not units:
        for c in model.children():
            members = list(c.children()) if isinstance(c, nn.ModuleDict) else [c]
            units += [m for m in members if any(True for _ in m.parameters())]
    return units


def assign_units(model: nn.Module, units: List[nn.Module]) -> Dict[int, Optional[int]]:
    """id(param) -> index of the unit that owns it, or None for the root unit.

    A parameter reachable from two units, or used directly by a module outside all units, or
    registered as external, belongs to the root.
    """
    owner: Dict[int, Optional[int]] = {}
    in_units: Set[int] = set()
    for i, unit in enumerate(units):
        for m in unit.modules():
            in_units.add(id(m))
            for p in m.parameters(recurse=False):
                prev = owner.get(id(p), i)
                owner[id(p)] = i if prev == i else None
    for m in model.modules():
        if id(m) not in in_units:
            for p in m.parameters(recurse=False):
                owner[id(p)] = None
        for p in getattr(m, EXTERNAL_ATTR, []):
            owner[id(p)] = None
    return owner


class Unit:
    """One gather/release group: spaces whose parameters are whole only while in use.

    Released, every parameter's `.data` is an empty tensor (shape [0]): stray use outside the
    unit's forward then fails with a shape error instead of reading freed memory. Gathered, the
    spaces' flat buffers get their bytes back, receive every rank's shard and the parameters
    become views into them.
    Autograd keeps working across the swap because it holds the parameter objects, whose data
    is whole again (re-gathered) when their backward runs.
    """

    def __init__(self, index: int, module: Optional[nn.Module], spaces: List[FlatSpace], topo: Topology):
        self.index, self.module, self.spaces, self.topo = index, module, spaces, topo
        self.numel = sum(s.numel for s in spaces)
        self.works: List[dist.Work] = []
        self.gathered = True  # the spaces start whole; `shard_out` then releases them
        self.pending_grads = 0
        self.params = [p for s in spaces for p in s.params]
        self.pinned = False  # held gathered by Stage3Controller.held(): release() waits for unpin

    def shard_out(self) -> None:
        """Keep only this rank's slice of every space (the optimizer writes into it).

        A space built from zero.Init partitions has its local shard already and no flat buffer.
        """
        for s in self.spaces:
            if s.local_shard is None:
                s.local_shard = s.gather_shard(s.flat)
        self.release()

    def gather(self) -> None:
        """Start the all-gathers (asynchronous); `wait` before the parameters are used."""
        if self.gathered:
            return
        for s in self.spaces:
            _fill_storage(s)
            for bucket, lo, hi, off in s.shard_slices():
                out = s.flat[bucket.start:bucket.start + bucket.numel]
                self.works.append(comm.all_gather(out, s.local_shard[off:off + hi - lo],
                                                  group=self.topo.group, async_op=True))
            for p, view in zip(s.ordered_params(), s.views_of(s.flat)):
                p.data = view
        self._mark(partition.ZeroParamStatus.AVAILABLE)
        self.gathered = True

    def _mark(self, status: "partition.ZeroParamStatus") -> None:
        for p in self.params:  # DeepSpeed's attribute, read by scripts that check before gathering
            p.ds_status = status

    def wait(self) -> None:
        self.gather()
        self.drain()

    def drain(self) -> None:
        """Wait for the all-gathers in flight, if any."""
        for w in self.works:
            w.wait()
        self.works.clear()

    def release(self) -> None:
        if not self.gathered or self.pinned:
            return
        self.drain()  # never free memory a collective still writes into
        for s in self.spaces:
            empty = torch.empty(0, dtype=s.dtype, device=s.device)
            for p in s.params:
                p.data = empty
            s.flat.untyped_storage().resize_(0)
        self._mark(partition.ZeroParamStatus.NOT_AVAILABLE)
        self.gathered = False


def _fill_storage(space: FlatSpace) -> None:
    """Give the space's flat buffer its bytes again (contents undefined until gathered into)."""
    nbytes = space.numel * space.flat.element_size()
    if space.flat.numel() != space.numel:  # a zero.Init space has had no whole buffer yet
        space.flat = torch.empty(space.numel, dtype=space.dtype, device=space.device)
    elif space.flat.untyped_storage().nbytes() < nbytes:
        space.flat.untyped_storage().resize_(nbytes)


class Stage3Controller:
    """Installs the hooks that gather, prefetch and release units around forward and backward."""

    def __init__(self, units: List[Unit], root: Optional[Unit], prefetch_numel: int):
        self.units, self.root, self.prefetch_numel = units, root, prefetch_numel
        self.order: List[int] = []  # unit indices in first-forward order
        self._recording = True
        self._handles: list = []
        self.access: Optional[Stage3Params] = None  # GatheredParameters' way in (build_controller)
        for unit in units:
            self._install(unit)
        for unit in units + ([root] if root else []):
            unit.shard_out()

    # ---- hooks ----------------------------------------------------------------------
    def _install(self, unit: Unit) -> None:
        # Every hook holds the controller and the unit weakly. The hooks live on the model, and
        # a parameter's gradient hooks are held from C++, where Python's collector cannot see
        # them: a hook holding its unit (whose params hold the hook) was a cycle never freed,
        # not by `del engine` nor at interpreter exit, and it kept the unit's Topology and so
        # the process group alive past `dist.destroy_process_group()`, with gloo's threads
        # still running while the process exits.
        ctl_ref, unit_ref = weakref.ref(self), weakref.ref(unit)

        def pre_forward(_m: nn.Module, _args: tuple) -> None:
            ctl, u = ctl_ref(), unit_ref()
            if ctl is not None and u is not None:
                ctl._before_use(u, forward=True)

        def post_forward(_m: nn.Module, _args: tuple, output):
            ctl, u = ctl_ref(), unit_ref()
            if ctl is None or u is None:
                return output
            if torch.is_grad_enabled():
                ctl._hook_outputs(u, output)
            u.release()
            return output

        # torch.compile must run these eagerly, not trace them: traced, the `p.data = view`
        # swaps become in-place updates inside the graph that bump the parameters' version
        # counters, and the backward then refuses the tensors it saved (at 2+ ranks, where units
        # really are gathered and released). Each hook is a graph break, as in DeepSpeed. (The
        # tensor hooks post_forward registers run in autograd's backward, which dynamo does not
        # trace: engine.compile() refuses compiled autograd.)
        pre_forward, post_forward = torch.compiler.disable(pre_forward), torch.compiler.disable(post_forward)
        self._handles.append(unit.module.register_forward_pre_hook(pre_forward))
        self._handles.append(unit.module.register_forward_hook(post_forward))
        for p in unit.params:
            self._handles.append(p.register_post_accumulate_grad_hook(_grad_hook(unit_ref)))

    def _hook_outputs(self, unit: Unit, output) -> None:
        # On the outputs' autograd nodes, which live as long as the caller keeps the loss.
        ctl_ref, unit_ref = weakref.ref(self), weakref.ref(unit)

        def pre_backward(grad: torch.Tensor) -> torch.Tensor:
            ctl, u = ctl_ref(), unit_ref()
            if ctl is not None and u is not None:
                ctl._before_use(u, forward=False)
            return grad
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(pre_backward)

    def _before_use(self, unit: Unit, forward: bool) -> None:
        if forward and self._recording and unit.index not in self.order:
            self.order.append(unit.index)
        unit.wait()
        self._prefetch(unit, forward)

    def _prefetch(self, unit: Unit, forward: bool) -> None:
        if unit.index not in self.order:
            return
        pos = self.order.index(unit.index)
        step = 1 if forward else -1
        budget = self.prefetch_numel
        pos += step
        while 0 <= pos < len(self.order) and budget > 0:
            nxt = self.units[self.order[pos]]
            if not nxt.gathered:
                nxt.gather()
            budget -= nxt.numel
            pos += step

    # ---- called by the engine ----------------------------------------------------------
    def before_forward(self) -> None:
        if self.root is not None:
            self.root.wait()

    def after_forward(self) -> None:
        """Without autograd (evaluation) nothing comes back for the root: release it now."""
        if self.order:
            self._recording = False
        if not torch.is_grad_enabled() and self.root is not None:
            self.root.release()

    def before_backward(self) -> None:
        for unit in self.units:
            unit.pending_grads = len(unit.params)

    def after_backward(self) -> None:
        """Units whose parameters got no gradient, and the root, are released here."""
        for unit in self.units + ([self.root] if self.root else []):
            unit.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Every unit gathered for the whole block and released after it: a pipeline stage's
        schedule runs forward and backward of every micro-batch in an order of its own, and its
        parameters are gathered once per step instead of twice per micro-batch."""
        every = self.units + ([self.root] if self.root else [])
        for unit in every:
            unit.gather()  # all launched, then all awaited
        for unit in every:
            unit.drain()
            unit.pinned = True
        try:
            yield
        finally:
            for unit in every:
                unit.pinned = False
                unit.release()

    def drain(self) -> None:
        """Wait for every all-gather in flight (a prefetched unit that never ran holds one)."""
        for unit in self.units + ([self.root] if self.root else []):
            unit.drain()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.access is not None:
            self.access.detach()


def _grad_hook(unit_ref: "weakref.ref[Unit]"):
    # Registered after the reducer's own hook, so when the last parameter's gradient has been
    # packed into its bucket the whole unit can be released.
    def hook(_p: torch.Tensor) -> None:
        unit = unit_ref()
        if unit is None:
            return
        unit.pending_grads -= 1
        if unit.pending_grads == 0:
            unit.release()
    return hook


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def build_stage3_spaces(model: nn.Module, groups, device: torch.device, bucket_numel: int,
                        topo: Topology, persistence_threshold: int):
    """Flat spaces for stage 3, and which unit each belongs to.

    Returns (spaces, unit_of_space, units) where unit_of_space[i] is a unit index, -1 for the
    root unit, or None for a persistent (stage-2 style, always whole) space. Parameters built
    under zero.Init stay partitioned: their spaces get no flat buffer, only the local shard,
    cut from one whole parameter at a time; persistent ones are gathered whole first.
    """
    units = unit_modules(model)
    owner = assign_units(model, units)
    spaces: List[FlatSpace] = []
    unit_of_space: List[Optional[int]] = []
    for gi, (params, _) in enumerate(groups):
        buckets: Dict[tuple, List[nn.Parameter]] = {}
        for p in params:
            small = partition.param_shape(p).numel() < persistence_threshold
            if small and partition.is_partitioned(p):
                partition.unpartition(p)
            key = (None if small else _root_or(owner.get(id(p))), p.dtype)
            buckets.setdefault(key, []).append(p)
        for (unit, dtype), ps in buckets.items():
            whole = not any(partition.is_partitioned(p) for p in ps)
            spaces.append(FlatSpace(list(reversed(ps)), dtype, device, bucket_numel, topo.world_size,
                                    topo.rank, gi, whole=whole))
            if not whole:
                partition.fill_local_shard(spaces[-1], topo.group)
            unit_of_space.append(unit)
    return spaces, unit_of_space, units


def _root_or(index: Optional[int]) -> int:
    return -1 if index is None else index


def build_controller(spaces: List[FlatSpace], unit_of_space: List[Optional[int]],
                     modules: List[nn.Module], topo: Topology, prefetch_numel: int,
                     zero=None) -> Stage3Controller:
    """Group the partitioned spaces into units and start the controller (releases them).

    With the ZeroOptimizer `zero`, GatheredParameters can reach the parameters (controller.access).
    """
    by_unit: Dict[int, List[FlatSpace]] = {}
    for space, unit in zip(spaces, unit_of_space):
        if unit is not None:
            by_unit.setdefault(unit, []).append(space)
    units = [Unit(i, modules[i], by_unit[i], topo) for i in sorted(k for k in by_unit if k >= 0)]
    for new_index, unit in enumerate(units):
        unit.index = new_index
    root = Unit(-1, None, by_unit[-1], topo) if -1 in by_unit else None
    ctl = Stage3Controller(units, root, prefetch_numel)
    if zero is not None:
        unit_of = {id(s): u for u in units + ([root] if root else []) for s in u.spaces}
        ctl.access = Stage3Params(spaces, [unit_of.get(id(s)) for s in spaces], zero, topo)
    return ctl
