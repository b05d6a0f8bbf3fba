"""Qwen3 self-attention over a paged KV cache: q/k/v in one matmul, per-head q/k RMSNorm (none
in Llama) with RoPE, then the backend writes K/V into pages and attends (GQA)."""

from __future__ import annotations

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.fp8_linear import make_linear
from batchrun.layers.norm import RMSNorm
from batchrun.layers.ops import TORCH_OPS
from batchrun.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    # Checkpoint tensors packed into one parameter: name -> (packed name, shard index).
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    # An FP8 KV pool's scales for this layer, [2] float32 (K's, V's; the runner sets them).
    kv_scale: torch.Tensor | None = None

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        fp8_block: tuple[int, int] | None = None,  # projections kept in FP8 blocks (fp8_linear)
        qk_norm: bool = True,  # off: no q_norm/k_norm weights, RoPE alone (Llama)
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = make_linear(hidden, self.q_size + 2 * self.kv_size, fp8_block)
        self.qkv_proj.shard_sizes = (self.q_size, self.kv_size, self.kv_size)  # type: ignore[assignment]
        self.o_proj = make_linear(self.q_size, hidden, fp8_block)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.scale = head_dim**-0.5
        self.ops = TORCH_OPS

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] normed and rotated, v [T, Hkv, D]."""
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        return self.rotate(q, k, positions, rope) + (v.view(-1, self.num_kv_heads, self.head_dim),)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        q, k = q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d)
        if self.q_norm is None or self.k_norm is None:
            return self.ops.qk_rope(q, k, rope.cos, rope.sin, positions)
        return self.ops.qk_norm_rope(
            q,
            k,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            rope.cos,
            rope.sin,
            positions,
        )

    def rotate_keys(
        self, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        """k [T, Hkv * D] normed (where the layer norms) and rotated, [T, Hkv, D] (a DFlash
        draft's context keys, which have no queries)."""
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is None:
            return self.ops.rope(k, rope.cos, rope.sin, positions)
        return self.ops.norm_rope(
            k, self.k_norm.weight, self.k_norm.eps, rope.cos, rope.sin, positions
        )

    def attend(
        self,
        q: torch.Tensor,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        out = backend.attend(q, kv_cache[0], kv_cache[1], self.scale, self.kv_scale)
        return self.o_proj(out.reshape(q.shape[0], self.q_size))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, positions, rope)
        backend.write_kv(k, v, kv_cache[0], kv_cache[1], kv_scale=self.kv_scale)
        return self.attend(q, backend, kv_cache)
