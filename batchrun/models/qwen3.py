"""Qwen3 causal LM reading and writing its KV cache through pages.

Module names mirror the Hugging Face checkpoint ("model.layers.0.self_attn.q_proj", ...), so
loading is a plain name-for-name copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchrun.layers.attention import AttentionBackend, PagedAttention
from batchrun.layers.mlp import SwiGLU
from batchrun.layers.norm import RMSNorm
from batchrun.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Qwen3Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool


class LayerWeights(nn.Module):
    """The weights of one Qwen3 decoder layer, under the checkpoint's names (also the DFlash
    draft's layers, which differ only in what they attend to)."""

    def __init__(self, s: Qwen3Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = PagedAttention(
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        )
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = SwiGLU(s.hidden_size, s.intermediate_size)


class DecoderLayer(LayerWeights):
    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, backend, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Body(nn.Module):
    def __init__(self, s: Qwen3Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Qwen3Body(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(shape.head_dim, shape.max_position_embeddings, shape.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the residual stream after the last layer [T, H] (before the final norm) and,
        when capture_layers is set, the concatenated outputs of those layers [T, len * H]."""
        x = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope, backend, kv_caches[i])
            if i in capture_layers:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        return x, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of pre-norm hidden rows."""
        return self.lm_head(self.model.norm(hidden)).float()
