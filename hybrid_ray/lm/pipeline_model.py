"""The project's GPT as a PipelineModule: the same layers, weights and loss as models.gpt.GPT,
given as a list so that its blocks can be cut into pipeline stages. The token embedding and the
output head share one weight (a TiedLayerSpec): when they land in different stages each holds
a copy that the engine keeps equal.

The head is a module (Embeddings.head, an nn.Linear whose weight is wte's), not a function of
wte.weight, so that a tensor-parallel plan can split it: GPTPipeline.tp_plan() is GPT.tp_plan()
under the PipelineModule's names, and the engine uses it when tensor_model_parallel_size > 1
and no tp_plan is given. Stages and tensor parallelism then compose: between stages the
activations are this tensor-parallel rank's slice of the sequence, sent to the same
tensor-parallel rank of the next stage."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import skip_init

from ..engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ..models.gpt import GPT, Block, GPTConfig


class Embeddings(nn.Module):
    """Token plus position embedding (GPT's wte and wpe), and the output head tied to wte as in
    GPT (head.weight is wte.weight: a plan splits the two the same way and the split keeps them
    one shard; the state dict names both, as GPT's does)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.apply(GPT._init_weights)
        # skip_init: a Linear built normally would draw its own (discarded) initial weight from
        # the global generator and shift every later layer's initial weights.
        self.head = skip_init(nn.Linear, cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class GPTBlock(Block):
    """A GPT block initialised as GPT initialises its blocks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init_weights)


def head(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    """The output head: the token embedding's weight, transposed (GPT's tie), through the
    module so that tensor parallelism's hooks on it run."""
    return embeddings.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT's loss: cross-entropy in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_layers(cfg: GPTConfig) -> List[Any]:
    return [TiedLayerSpec("embed", Embeddings, cfg),
            *[LayerSpec(GPTBlock, cfg) for _ in range(cfg.n_layer)],
            LayerSpec(nn.LayerNorm, cfg.d_model),
            TiedLayerSpec("embed", Embeddings, cfg, forward_fn=head, tied_weight_attr="wte.weight")]


class GPTPipeline(PipelineModule):
    """The GPT's layers as a PipelineModule, with the GPT's tensor-parallel plan."""

    def __init__(self, cfg: GPTConfig, **kwargs: Any) -> None:
        super().__init__(layers=gpt_layers(cfg), loss_fn=lm_loss, **kwargs)
        self.cfg = cfg

    def tp_plan(self) -> Dict[str, Any]:
        """GPT.tp_plan() under this module's names: layer 0 is the embedding (its wte and the
        tied head under tied_modules.embed), layers 1..n_layer the blocks, n_layer + 1 the final
        norm. Patterns naming layers of other stages are fine (the engine checks the pipeline
        as a whole). seq_len and n_head must divide by the tensor-parallel size."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                       RowwiseParallel, SequenceParallel)

        return {
            "tied_modules.embed.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "1": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                    use_local_output=True),
            "*.ln1": "sequence", "*.ln2": "sequence",
            # The final norm's output as a plain local tensor (not the DTensor "sequence" gives):
            # a cut between it and the head would send it between stages.
            str(self.cfg.n_layer + 1): SequenceParallel(use_local_output=True),
            "*.qkv": "colwise:3",  # q, k and v each split, so a rank holds whole heads
            "*.fc": "colwise",
            "*.proj": "rowwise", "*.out": "rowwise",
            "tied_modules.embed.head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }


def gpt_pipeline(cfg: GPTConfig, num_stages: Any = None, **kwargs: Any) -> GPTPipeline:
    """GPT as a PipelineModule (kwargs: PipelineModule's, e.g. partition_method, seed_layers).
    Without num_stages the config's pipeline_model_parallel_size cuts it at initialize."""
    return GPTPipeline(cfg, num_stages=num_stages, **kwargs)


def is_pipeline_state(state: Dict[str, Any]) -> bool:
    """Whether a state dict has GPTPipeline's names (a checkpoint of a pipelined run)."""
    return "tied_modules.embed.wte.weight" in state


def as_gpt_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """GPTPipeline's state dict under models.gpt.GPT's names (the same tensors): the exported
    model of a pipelined run loads into the GPT that the rest of the world uses. A state dict
    with GPT's names already comes back unchanged."""
    if not is_pipeline_state(state):
        return dict(state)
    last = max(int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit())
    out: Dict[str, Any] = {}
    for key, value in state.items():
        first, _, rest = key.partition(".")
        if first == "tied_modules":  # tied_modules.embed.{wte,wpe,head}.weight
            out[rest.partition(".")[2]] = value
        elif int(first) == last:  # the final LayerNorm
            out[f"ln_f.{rest}"] = value
        else:  # layer i (1..n_layer) is block i - 1
            out[f"blocks.{int(first) - 1}.{rest}"] = value
    return out
