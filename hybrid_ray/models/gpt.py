"""A GPT-2-style decoder: the model of the anchor benchmark, usable at any size.

Same structure as ../shared/anchors/gpt_bench.py (pre-norm blocks, fused qkv, tied embedding and
output head, SDPA attention), so benchmark figures compare like with like.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

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
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(d)
        b = cfg.bias
        self.qkv = nn.Linear(d, 3 * d, bias=b)
        self.proj = nn.Linear(d, d, bias=b)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=b)
        self.out = nn.Linear(4 * d, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
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
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # The loss in fp32 whatever the compute dtype: a half-precision log-softmax over a large
        # vocabulary loses the small probabilities the loss is made of.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
