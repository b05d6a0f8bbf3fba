"""The hybrid models' full-attention layer (Qwen3.5, Qwen3-Next) over the paged KV cache:
Qwen3's attention but q_proj also gives each head an output gate (its rows are per head
[query, gate]), q/k RMSNorms are zero-centred, and RoPE turns only the first rotary_dim
dimensions of each head (partial_rotary_factor)."""

from __future__ import annotations

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.fp8_linear import make_linear
from batchrun.layers.norm import ZeroCentredRMSNorm
from batchrun.layers.rotary import RotaryEmbedding


class GatedAttention(nn.Module):
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
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = make_linear(hidden, 2 * self.q_size + 2 * self.kv_size, fp8_block)
        self.qkv_proj.shard_sizes = (2 * self.q_size, self.kv_size, self.kv_size)  # type: ignore[assignment]
        self.o_proj = make_linear(self.q_size, hidden, fp8_block)
        self.q_norm = ZeroCentredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, eps)
        self.scale = head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,  # rotary_dim's tables
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split((2 * self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q), rope, positions)
        k = partial_rope(self.k_norm(k.view(t, self.num_kv_heads, d)), rope, positions)
        backend.write_kv(k, v.view(t, self.num_kv_heads, d), *kv_cache, kv_scale=self.kv_scale)
        out = backend.attend(q.contiguous(), kv_cache[0], kv_cache[1], self.scale, self.kv_scale)
        gated = out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.o_proj(gated)


def partial_rope(x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, in float32, of the first 2 * rope.cos.shape[1] dimensions of each head
    of x [T, heads, D]; the rest pass unchanged."""
    half = rope.cos.shape[1]
    c, s = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((turned, x[..., 2 * half :]), dim=-1)
