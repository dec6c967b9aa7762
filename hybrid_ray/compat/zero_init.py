"""`zero.Init`: build a model with every parameter partitioned across ranks as it is created.

    with hybrid_ray.zero.Init(config_dict_or_path=ds_config):
        model = MyModel()          # each rank holds 1/N of every parameter
    engine, *_ = hybrid_ray.initialize(model=model, config=ds_config)   # stage 3 uses the shards

How the weights come out equal to a model built normally. A parameter is partitioned the
moment a module registers it (nn.Module.register_parameter is patched for the context): rank 0's
values are scattered, each rank keeps its slice, `.data` becomes empty. Initialisation code
that runs afterwards (the module's own reset_parameters, a parent's `self.apply(_init_weights)`,
nanoGPT's special init of projections) is caught by a torch-function mode: any torch call that
touches a partitioned parameter first makes that one parameter whole again (gathered from the
shards, or just allocated when the call overwrites it all: nn.init.*, normal_, zero_, copy_...),
runs the call on the whole tensor, and partitions the result again once nothing refers to it.
Every call therefore runs on the same whole tensors, in the same order, drawing the same random
numbers as without Init: the same seed gives the same weights at every world size. Shape
queries (`.shape`, `.size()`, `.dim()`, `.numel()`) are answered from the recorded shape without
gathering. The peak is the shards plus the parameters in use at once (one, for usual init code).

As with DeepSpeed, code run under Init must make the same calls on every rank wherever they
touch a partitioned parameter (gathers and scatters are collectives; calls that touch none, such
as rank 0 writing a parameter gathered with GatheredParameters, never communicate), and the context is a no-op when disabled, at one rank, or when the
config's ZeRO stage is not 3. A `.data` alias still held when the context exits is detached
from the parameter (its later writes are lost).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..config import NotSupportedError, load_config
from ..engine import Topology
from ..engine.zero import partition as zp

_ACTIVE: List["Init"] = []  # the Init contexts now open (the outermost does the work)
_SHAPE_QUERIES = {"dim", "ndimension", "size", "numel", "nelement", "__len__"}
_SHAPE_ATTRS = {"shape", "ndim"}
_WHOLE_ATTRS = {"data", "T", "mT", "H", "mH", "real", "imag"}  # getters that read the values
_METADATA = {"requires_grad_", "is_floating_point", "is_complex", "element_size", "__hash__",
             "get_device", "register_hook", "register_post_accumulate_grad_hook", "is_contiguous"}
_OVERWRITE = {"normal_", "uniform_", "zero_", "fill_", "random_", "exponential_", "geometric_",
              "log_normal_", "cauchy_", "bernoulli_", "copy_"}


def _attr(func: Any) -> Optional[str]:
    """'data' for Tensor.data.__get__/__set__, else None."""
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return None


@dataclass
class _Live:
    """A partitioned parameter made whole for a call, and the tensors that still alias it."""

    param: nn.Parameter
    version: int
    dirty: bool
    aliases: List[weakref.ref] = field(default_factory=list)

    def held(self) -> bool:
        self.aliases = [a for a in self.aliases if a() is not None]
        return bool(self.aliases)


class _PartitionMode(TorchFunctionMode):
    """Makes partitioned parameters whole, one call at a time, while Init is open."""

    def __init__(self, owner: "Init"):
        super().__init__()
        self.owner = owner
        self.live: Dict[int, _Live] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, attr = getattr(func, "__name__", ""), _attr(func)
        # nn.init functions arrive with their tensor as a keyword (handle_torch_function)
        first = args[0] if args else kwargs.get("tensor")
        if self._partitioned(first):
            if attr in _SHAPE_ATTRS or name in _SHAPE_QUERIES:
                return _shape_answer(zp.partition_of(first).shape, name, attr, args[1:], kwargs)
            if attr == "data" and name == "__set__":
                self.owner.repartition(first, args[1])
                return None
            if (attr is not None and attr not in _WHOLE_ATTRS) or name in _METADATA:
                return func(*args, **kwargs)
        params = [a for a in tree_leaves((args, kwargs)) if self._partitioned(a)]
        if not params:  # no collective here: rank-dependent code (`if rank == 0:`) stays safe
            out = func(*args, **kwargs)
            self._track(out)
            return out
        self.settle()  # every rank makes this call (it touches a partitioned parameter)
        overwrite = first is not None and (name in _OVERWRITE or _is_init_function(func))
        for p in _unique(params):
            self.make_whole(p, read=not (overwrite and p is first))
        out = func(*args, **kwargs)
        self._track(out)
        self.settle()
        return out

    def _partitioned(self, t: Any) -> bool:
        return isinstance(t, nn.Parameter) and zp.is_partitioned(t) and id(t) not in self.live \
            and t.ds_status == zp.ZeroParamStatus.NOT_AVAILABLE

    def make_whole(self, p: nn.Parameter, read: bool) -> None:
        part = zp.partition_of(p)
        if read:
            zp.gather(p)
        else:
            p.data = torch.empty(part.shape, dtype=part.shard.dtype, device=part.shard.device)
            zp._mark(p, part, zp.ZeroParamStatus.AVAILABLE)
        self.live[id(p)] = _Live(p, p._version, dirty=not read)

    def _track(self, out: Any) -> None:
        """Tensors returned by a call that share a whole parameter's storage keep it whole."""
        if not self.live:
            return
        ptrs = {live.param.untyped_storage().data_ptr(): live for live in self.live.values()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.layout == torch.strided:
                live = ptrs.get(t.untyped_storage().data_ptr())
                if live is not None:  # the alias may be written through: partition again from it
                    live.aliases.append(weakref.ref(t))
                    live.dirty = True

    def settle(self, force: bool = False) -> None:
        """Partition again every whole parameter nothing refers to any more (all, with force)."""
        for key, live in list(self.live.items()):
            if force or not live.held():
                del self.live[key]
                p = live.param
                if live.dirty or p._version != live.version or force:
                    self.owner.repartition(p, p.data)
                else:  # only read: the shards are still right
                    zp.release(p)


def _is_init_function(func: Any) -> bool:
    """nn.init.normal_, kaiming_uniform_, ...: they overwrite the whole tensor."""
    return getattr(func, "__module__", "") == "torch.nn.init" and func.__name__.endswith("_")


def _shape_answer(shape: torch.Size, name: str, attr: Optional[str], rest: tuple, kwargs: dict) -> Any:
    if attr == "shape":
        return shape
    if attr == "ndim" or name in ("dim", "ndimension"):
        return len(shape)
    if name in ("numel", "nelement"):
        return shape.numel()
    if name == "__len__":
        return shape[0]
    dim = rest[0] if rest else kwargs.get("dim")
    return shape if dim is None else shape[dim]


def _unique(params: List[nn.Parameter]) -> List[nn.Parameter]:
    seen: Dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


class Init:
    """DeepSpeed's `zero.Init`: parameters created inside are partitioned across the group.

    config_dict_or_path (or `config`): the run's config; a ZeRO stage other than 3 turns the
    context into a no-op. remote_device: None keeps shards on the engine's device, "cpu" on the
    host ("nvme" is refused). dtype: store the shards in this dtype (default: as created; the
    engine casts at initialize). data_parallel_group or mpu.get_data_parallel_group(): the ranks
    the parameters are spread over (default: all). module: partition an existing module's
    parameters now, as if it had been built inside the context.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu: Any = None,
                 zero_quantized_weights: bool = False, **_unused: Any):
        if remote_device not in (None, "cpu", "cuda", "none"):
            raise NotSupportedError(f"zero.Init(remote_device={remote_device!r}): not supported; "
                                    "allowed: None, 'cpu' (NVMe parameter offload is not implemented)")
        if zero_quantized_weights:
            raise NotSupportedError("zero.Init(zero_quantized_weights=True): not supported")
        source = config_dict_or_path if config_dict_or_path is not None else config
        stage3 = source is None or load_config(source).zero_optimization.stage == 3
        if mpu is not None and data_parallel_group is None:
            data_parallel_group = mpu.get_data_parallel_group()
        topo = Topology.from_environment() if enabled and stage3 else None
        self.group = data_parallel_group if data_parallel_group is not None else \
            (topo.group if topo else None)
        world = dist.get_world_size(self.group) if self.group is not None else 1
        self.enabled = bool(enabled and stage3 and world > 1)
        self.device = torch.device("cpu") if remote_device == "cpu" else (topo.device if topo else None)
        self.pin = bool(pin_memory and self.device is not None and self.device.type == "cpu"
                        and torch.cuda.is_available())
        self.dtype = dtype
        self._mode: Optional[_PartitionMode] = None
        self._original = None
        if module is not None and self.enabled:
            with torch._C.DisableTorchFunction():
                for p in _unique(list(module.parameters())):
                    if not zp.is_partitioned(p):
                        self._partition(p)

    # ---- the context ------------------------------------------------------------------
    def __enter__(self) -> "Init":
        _ACTIVE.append(self)
        if not self.enabled or any(i._mode is not None for i in _ACTIVE[:-1]):
            return self  # disabled, or an outer Init already partitions everything
        self._original = nn.Module.register_parameter
        nn.Module.register_parameter = _registering(self, self._original)
        self._mode = _PartitionMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        try:
            with torch._C.DisableTorchFunction():
                mode.settle(force=True)
        finally:
            mode.__exit__(*exc)
            nn.Module.register_parameter = self._original

    # ---- partitioning -----------------------------------------------------------------
    def _partition(self, p: nn.Parameter) -> None:
        zp.partition(p, self.group, self.device or p.device, self.dtype)
        if self.pin:
            zp.partition_of(p).shard = zp.partition_of(p).shard.pin_memory()
            zp.release(p)

    def repartition(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """New whole values for a partitioned parameter: keep this rank's slice of rank 0's."""
        part = zp.partition_of(p)
        with torch.no_grad():
            part.set_from(value.detach(), dtype=value.dtype)
        if self.pin:
            part.shard = part.shard.pin_memory()
        zp.release(p)


def _registering(init: Init, original):
    """nn.Module.register_parameter that partitions what it registers (bound to one Init)."""
    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        # A parameter made on the meta device (torch's skip_init, a deferred init) has no values
        # to cut yet: to_empty or a load gives it storage later, and initialize partitions it then.
        if param is None or param.is_meta or zp.is_partitioned(param) or init._mode is None:
            return
        with torch._C.DisableTorchFunction():
            init._mode.settle()
            init._partition(param)
    return register_parameter


def check_mics_shard_size(shard_size: int, world: int) -> None:
    """MiCS with one shard group spanning the data-parallel world is ZeRO-3's partitioning; a
    smaller group (parameters replicated across groups) is not implemented."""
    if shard_size not in (-1, world):
        raise NotSupportedError(
            f"zero_optimization.mics_shard_size: not supported yet; got {shard_size} at data-parallel "
            f"world size {world}; allowed: -1 or {world} (MiCS over the whole world, which is ZeRO-3; "
            "replicated shard groups are not implemented)")


class MiCS_Init(Init):
    """DeepSpeed's `zero.MiCS_Init`: a zero.Init whose shard group is mics_shard_size ranks.
    Supported where that is the whole data-parallel world (then it is zero.Init exactly)."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 sequence_data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, **kwargs: Any):
        super().__init__(module=module, data_parallel_group=data_parallel_group,
                         mem_efficient_linear=mem_efficient_linear, remote_device=remote_device,
                         pin_memory=pin_memory, config_dict_or_path=config_dict_or_path,
                         config=config, enabled=enabled, dtype=dtype, mpu=mpu, **kwargs)
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
            world = dist.get_world_size(self.group) if self.group is not None else 1
            check_mics_shard_size(load_config(source).zero_optimization.mics_shard_size, world)
