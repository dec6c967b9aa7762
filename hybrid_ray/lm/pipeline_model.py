"""The project's GPT as a PipelineModule: the same layers, weights and loss as models.gpt.GPT,
given as a list so that its blocks can be cut into pipeline stages. The token embedding and the
output head share one weight (a TiedLayerSpec): when they land in different stages each holds
a copy that the engine keeps equal."""
from __future__ import annotations

from typing import Any, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ..models.gpt import GPT, Block, GPTConfig


class Embeddings(nn.Module):
    """Token plus position embedding (GPT's wte and wpe)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.apply(GPT._init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class GPTBlock(Block):
    """A GPT block initialised as GPT initialises its blocks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init_weights)


def head(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    """The output head: the token embedding's weight, transposed (GPT's tie)."""
    return F.linear(x, embeddings.wte.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT's loss: cross-entropy in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_layers(cfg: GPTConfig) -> List[Any]:
    return [TiedLayerSpec("embed", Embeddings, cfg),
            *[LayerSpec(GPTBlock, cfg) for _ in range(cfg.n_layer)],
            LayerSpec(nn.LayerNorm, cfg.d_model),
            TiedLayerSpec("embed", Embeddings, cfg, forward_fn=head, tied_weight_attr="wte.weight")]


def gpt_pipeline(cfg: GPTConfig, num_stages: int = 1, **kwargs: Any) -> PipelineModule:
    """GPT as a PipelineModule (kwargs: PipelineModule's, e.g. partition_method, seed_layers)."""
    return PipelineModule(layers=gpt_layers(cfg), loss_fn=lm_loss, num_stages=num_stages, **kwargs)
