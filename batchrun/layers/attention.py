"""Qwen3 self-attention over a paged KV cache: per-head q/k RMSNorm, then RoPE, then GQA."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from batchrun.layers.attention_meta import AttentionMeta
from batchrun.layers.norm import RMSNorm
from batchrun.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    """Plans once per forward from its AttentionMeta, then serves every layer."""

    name: str

    def plan(self, meta: AttentionMeta) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v rows at the planned slots, then attend the q rows over the cached K/V."""
        ...


class PagedAttention(nn.Module):
    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.scale = head_dim**-0.5

    def project_kv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return rope(k, positions), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        q = rope(q, positions)
        k, v = self.project_kv(x, positions, rope)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))
