"""PipelineModule: a model as an ordered list of layers, DeepSpeed's `deepspeed.pipe` API.

Layers are modules, `LayerSpec`s (built here, so a stage builds only its own layers once stages
exist), `TiedLayerSpec`s (every spec with the same key shares one module: an embedding reused
as the output head) or plain callables such as `lambda x: x.flatten(1)`. The output of each
layer is the input of the next; `loss_fn(outputs, labels)` gives the loss that train_batch()
backpropagates.

With num_stages > 1 (the process group must exist first) the layers are cut into that many
stages by partition_method ('parameters': balanced parameter counts, 'uniform': layer counts,
'type:<regex>': counts of the layers whose class matches), each rank builds only its stage's
layers (layout.py places ranks: rank = stage * dp + d), and the engine runs them through
torch.distributed.pipelining (stages.py). activation_checkpoint_interval runs every chunk of
that many layers under torch.utils.checkpoint, as DeepSpeed recomputes them.

stages_per_rank V > 1 (ours; the interleaved schedule) cuts the layers into num_stages * V
stages and rank r of a pipeline holds stages r, r + P, ..., each a chunk of its own
(forward(x, chunk=k)): the pipeline's fill and drain shrink by V for more messages. A parameter
keeps the name of its layer's index, so checkpoints stay those of the unsplit model.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ...config import ConfigError
from ...config.sections import check_partition_method
from . import layout
from ..zero.stage3 import register_external_parameter


class LayerSpec:
    """A layer not built yet: `LayerSpec(nn.Linear, 4, 8)` builds `nn.Linear(4, 8)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ConfigError(f"LayerSpec: typename must be an nn.Module class; got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A LayerSpec whose module is shared by every TiedLayerSpec with the same `key`;
    `forward_fn(module, x)` (if given) is how this occurrence uses it."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr


class _Tied:
    """One use of a tied module, through its spec's forward_fn. A plain callable, not a
    submodule: the module's parameters are registered once, under `tied_modules.<key>`."""

    def __init__(self, owner: nn.ModuleDict, key: str, forward_fn: Optional[Callable]) -> None:
        self.owner, self.key, self.forward_fn = owner, key, forward_fn

    @property
    def module(self) -> nn.Module:
        return self.owner[self.key]

    def __call__(self, x: Any) -> Any:
        return self.module(x) if self.forward_fn is None else self.forward_fn(self.module, x)


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule(layers, num_stages=None, topology=None, loss_fn=None,
    seed_layers=False, seed_fn=None, base_seed=1234, partition_method='parameters',
    activation_checkpoint_interval=0, activation_checkpoint_func=checkpoint,
    checkpointable_layers=None, dynamic_shape=False)`, and stages_per_rank (ours)."""

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None, topology: Any = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False,
                 seed_fn: Optional[Callable[[int], None]] = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Optional[Callable] = None,
                 checkpointable_layers: Optional[List[str]] = None, dynamic_shape: bool = False,
                 stages_per_rank: int = 1) -> None:
        super().__init__()
        stages = num_stages if num_stages is not None else getattr(topology, "get_dim", lambda _: 1)("pipe")
        if stages is None or int(stages) < 1:
            raise ConfigError(f"PipelineModule num_stages: must be >= 1; got {stages}")
        if activation_checkpoint_interval < 0:
            raise ConfigError("PipelineModule activation_checkpoint_interval: must be >= 0; got "
                              f"{activation_checkpoint_interval}")
        if int(stages_per_rank) < 1:
            raise ConfigError(f"PipelineModule stages_per_rank: must be >= 1; got {stages_per_rank}")
        check_partition_method(partition_method, "PipelineModule partition_method")
        self.num_stages, self.loss_fn = int(stages), loss_fn
        self.stages_per_rank = int(stages_per_rank)
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or (
            lambda fn, *args: torch_checkpoint(fn, *args, use_reentrant=False))
        self.checkpointable_layers = checkpointable_layers
        # Without num_stages the config's pipeline_model_parallel_size decides, at initialize
        # (place()): the layers are kept so they can be cut then.
        self.stages_given = num_stages is not None or topology is not None
        self._specs = None if self.stages_given else list(layers)
        # More than one stage: this rank builds only its stage's layers (layout.py places it).
        self.pipe_layout = layout.build_layout(self.num_stages) if self.num_stages > 1 else None
        self.stage_id = self.pipe_layout.stage if self.pipe_layout else 0
        self.parts = self._partition(list(layers))
        self.tied_modules = nn.ModuleDict()
        # this rank's chunks (one per stage it holds), in order: modules, tied uses, callables
        self._chunks: List[List[Any]] = []
        for lo, hi in self.chunk_bounds():
            chunk = []
            for i in range(lo, hi):
                if seed_layers:
                    (seed_fn or torch.manual_seed)(base_seed + i)
                chunk.append(self._build(layers[i], i))
            self._chunks.append(chunk)
        # A tied module used by several stages lives on each of them: one group per key and
        # pipeline makes their weights start equal and sums their gradients every step.
        self.tie_groups: Dict[str, Tuple[Any, List[int]]] = {}
        if self.pipe_layout is not None:
            self._tie_across_stages(self._tied_ranks(layers))

    @property
    def virtual_stages(self) -> List[int]:
        """The stages (of num_stages * stages_per_rank) this rank holds, in order."""
        if self.num_stages == 1:
            return [0]
        return [self.stage_id + k * self.num_stages for k in range(self.stages_per_rank)]

    def chunk_bounds(self) -> List[Tuple[int, int]]:
        """[lo, hi) layer indexes of each chunk this rank holds."""
        return [(self.parts[v], self.parts[v + 1]) for v in self.virtual_stages]

    def _tied_ranks(self, layers: Sequence[Any]) -> Dict[str, List[int]]:
        """For each tied key, the pipeline positions (ranks' stages) that hold it."""
        return {key: sorted({v % self.num_stages for v in where})
                for key, where in _tied_stages(layers, self.parts).items()}

    def place(self, lay: "layout.PipeLayout", stages_per_rank: int = 1,
              partition_method: Optional[str] = None) -> None:
        """Cut a module built whole (no num_stages) into lay.num_stages * stages_per_rank stages
        and keep this rank's: the engine does it when the config's pipeline_model_parallel_size
        asks for stages. The layers were built in one-process order, so a stage's weights are
        the ones a single process starts from. Collective (the tie groups)."""
        if self.stages_given or self.num_stages != 1:
            raise ConfigError("PipelineModule.place(): only a module built without num_stages can be "
                              f"cut into stages; this one has num_stages={self.num_stages}")
        specs, built = self._specs, self._chunks[0]
        self.num_stages, self.pipe_layout, self.stage_id = lay.num_stages, lay, lay.stage
        self.stages_per_rank = stages_per_rank
        self.partition_method = partition_method or self.partition_method
        self.parts = self._partition(specs)
        bounds = self.chunk_bounds()
        kept = {i for lo, hi in bounds for i in range(lo, hi)}
        for i in [i for i in range(len(specs)) if i not in kept]:
            self._modules.pop(str(i), None)
        keys = {specs[i].key for i in kept if isinstance(specs[i], TiedLayerSpec)}
        for key in [k for k in self.tied_modules if k not in keys]:
            del self.tied_modules[key]
        self._chunks = [built[lo:hi] for lo, hi in bounds]
        self._tie_across_stages(self._tied_ranks(specs))

    def _tie_across_stages(self, stages_of: Dict[str, List[int]]) -> None:
        lay = self.pipe_layout
        for key in sorted(stages_of):  # the same order on every rank: new_group is collective
            stages = stages_of[key]
            if len(stages) < 2:
                continue
            for pipe in range(lay.pipes):
                ranks = lay.pipeline_ranks(stages, pipe)
                group = dist.new_group(ranks)
                if pipe == lay.pipe_index and lay.stage in stages:
                    self.tie_groups[key] = (group, ranks)
        for key, (group, ranks) in self.tie_groups.items():
            for p in self.tied_modules[key].parameters():
                dist.broadcast(p.data, src=ranks[0], group=group)

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of weights tied across stages over the stages that hold them."""
        for key, (group, _) in self.tie_groups.items():
            for p in self.tied_modules[key].parameters():
                # every holder takes part, with zeros if its stage left this parameter unused
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad, group=group)
                if p.grad is None:
                    p.grad = grad

    def duplicate_tied_params(self) -> set:
        """Ids of the tied weights that an earlier stage also holds (and counts in the norm)."""
        return {id(p) for key, (_, ranks) in self.tie_groups.items() if dist.get_rank() != ranks[0]
                for p in self.tied_modules[key].parameters()}

    def _partition(self, layers: List[Any]) -> List[int]:
        """Layer boundaries of the stages, by partition_method ('parameters' counts each
        layer's parameters, building a LayerSpec to count it, as DeepSpeed does)."""
        if self.num_stages == 1:
            return [0, len(layers)]
        method = self.partition_method.lower()
        if method == "uniform":
            weights = [1.0] * len(layers)
        elif method == "parameters":
            weights = [float(_param_count(layer)) for layer in layers]
        else:
            pattern = re.compile(self.partition_method[5:], re.IGNORECASE)
            weights = [1.0 if pattern.search(_type_name(layer)) else 0.0 for layer in layers]
        return layout.partition(weights, self.num_stages * self.stages_per_rank)

    def _build(self, layer: Any, index: int) -> Any:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                # Used by this module's forward at each of its places, through forward_fn
                # (a GPT's head reads the embedding's weight): under ZeRO-3 it stays gathered
                # for the whole step, as a plain model's tied weights do.
                for p in self.tied_modules[layer.key].parameters():
                    register_external_parameter(self, p)
            return _Tied(self.tied_modules, layer.key, layer.forward_fn)
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)  # DeepSpeed's names: "<layer index>.weight"
            return layer
        if callable(layer):
            return layer
        raise ConfigError(f"PipelineModule layers[{index}]: expected an nn.Module, a LayerSpec or a "
                          f"callable; got {type(layer).__name__}")

    def _checkpointable(self, funcs: List[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        modules = [f.module if isinstance(f, _Tied) else f for f in funcs]
        return any(isinstance(m, nn.Module) and next(m.parameters(), None) is not None for m in modules)

    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        """This rank's stage (its `chunk`-th, when it holds several) applied to the input."""
        x, layers = forward_input, self._chunks[chunk]
        interval = self.activation_checkpoint_interval if self.training else 0
        if interval == 0:
            for layer in layers:
                x = layer(x)
            return x
        for start in range(0, len(layers), interval):
            funcs = layers[start:start + interval]
            run = _chunk(funcs)
            if self._checkpointable(funcs) and torch.is_grad_enabled():
                x = self.activation_checkpoint_func(run, *(x if isinstance(x, tuple) else (x,)))
            else:
                x = run(*(x if isinstance(x, tuple) else (x,)))
        return x

    def topology(self) -> None:
        return None  # no DeepSpeed ProcessTopology object: the placement is `pipe_layout`

    def num_pipeline_stages(self) -> int:
        return self.num_stages


def layout_of(model: Any) -> Optional["layout.PipeLayout"]:
    """The stage placement of a PipelineModule split into stages, else None."""
    return model.pipe_layout if isinstance(model, PipelineModule) else None


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def _param_count(layer: Any) -> int:
    if isinstance(layer, LayerSpec):  # a TiedLayerSpec too
        layer = layer.build()  # built to be counted, then dropped (DeepSpeed does the same)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    return 0


def _tied_stages(layers: Sequence[Any], parts: List[int]) -> Dict[str, List[int]]:
    stages: Dict[str, set] = {}
    for s in range(len(parts) - 1):
        for layer in layers[parts[s]:parts[s + 1]]:
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(s)
    return {key: sorted(where) for key, where in stages.items()}


def _chunk(funcs: List[Any]) -> Callable:
    def run(*inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for f in funcs:
            x = f(x)
        return x
    return run
