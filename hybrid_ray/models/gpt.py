"""A GPT-2-style decoder: the model of the anchor benchmark, usable at any size.

Same structure as ../shared/anchors/gpt_bench.py (pre-norm blocks, fused qkv, tied embedding and
output head, SDPA attention), so benchmark figures compare like with like.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """n_layer blocks of width d_model with n_head heads; vocab and context length."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256
    seq_len: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in the blocks' linear layers (nanoGPT's switch)


GPT_SIZES: Dict[str, GPTConfig] = {
    "tiny": GPTConfig(2, 2, 32, 64, 16),
    "small": GPTConfig(4, 4, 128, 256, 128),
    "124m": GPTConfig(12, 12, 768, 50304, 1024),
    "350m": GPTConfig(24, 16, 1024, 50304, 1024),
    "774m": GPTConfig(36, 20, 1280, 50304, 1024),
    "1.3b": GPTConfig(24, 32, 2048, 50304, 1024),
    # GPT-3's 2.7B and 6.7B, and Megatron-LM's 8.3B: the sizes where optimizer offload decides
    # whether a model trains on one GPU at all.
    "2.7b": GPTConfig(32, 32, 2560, 50304, 1024),
    "6.7b": GPTConfig(32, 32, 4096, 50304, 1024),
    "8.3b": GPTConfig(72, 32, 3072, 50304, 1024),
    # Between and beyond those, to find the largest model each offload trains on one GPU.
    "3.8b": GPTConfig(32, 32, 3072, 50304, 1024),
    "5b": GPTConfig(24, 32, 4096, 50304, 1024),
    "5.8b": GPTConfig(28, 32, 4096, 50304, 1024),
    "10b": GPTConfig(48, 32, 4096, 50304, 1024),
    "11.5b": GPTConfig(56, 32, 4096, 50304, 1024),
    "13b": GPTConfig(40, 40, 5120, 50304, 1024),  # GPT-3's 13B
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(d)
        b = cfg.bias
        self.qkv = nn.Linear(d, 3 * d, bias=b)
        self.proj = nn.Linear(d, d, bias=b)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=b)
        self.out = nn.Linear(4 * d, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes from qkv's output, heads as -1: under tensor parallelism x holds a slice of the
        # sequence and qkv this rank's heads (tp_plan below); whole, the same as (B, T, 3C).
        qkv = self.qkv(self.ln1(x))
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Returns the mean cross-entropy when targets are given, else the logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases (keeps initial logits small)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final norm, the output head and the loss: a method of its own so that it can be
        compiled apart from the blocks (fused, the fp32 logits are never materialised)."""
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # The loss in fp32 whatever the compute dtype: a half-precision log-softmax over a large
        # vocabulary loses the small probabilities the loss is made of.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def tp_plan(self) -> Dict[str, Any]:
        """How tensor parallelism splits this model (initialize's tp_plan; the engine asks for it
        when tensor_model_parallel_size > 1 and none is given): Megatron's attention and MLP
        split (q, k, v and fc column-wise, proj and out row-wise) with sequence-parallel norms,
        the embedding split over the vocabulary and the tied head over the same rows, as
        torchtitan does. The sequence is split after the position embedding is added, so
        seq_len must divide by the tensor-parallel size, and n_head too."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                       RowwiseParallel)

        return {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "blocks.*.ln1": "sequence", "blocks.*.ln2": "sequence", "ln_f": "sequence",
            "blocks.*.qkv": "colwise:3",  # q, k and v each split, so a rank holds whole heads
            "blocks.*.fc": "colwise",
            "blocks.*.proj": "rowwise", "blocks.*.out": "rowwise",
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
