"""Qwen3 causal LM reading and writing its KV cache through pages; Llama 3 is the same model
without the per-head q/k RMSNorm (`Qwen3Shape.qk_norm` off).

Module names mirror the Hugging Face checkpoint ("model.layers.0.self_attn.o_proj", ...), except
that q/k/v and gate/up are packed into one matmul each (`PACKED` says how the loader fills them).
Qwen3-MoE is the same model with a sparse block of experts in place of some layers' MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.attention import PagedAttention
from batchrun.layers.mlp import SwiGLU
from batchrun.layers.moe import SparseMoe
from batchrun.layers.norm import RMSNorm
from batchrun.layers.rotary import RopeScaling, RotaryEmbedding
from batchrun.models.fp8 import Fp8Scheme


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
    max_position_embeddings: int  # the positions it addresses (with YaRN: factor x original)
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = True  # Qwen3's per-head RMSNorm of q and k before RoPE (Llama has none)
    fp8: Fp8Scheme | None = None  # an FP8 checkpoint's scales (see fp8_block)
    # Qwen3-MoE: experts of moe_intermediate_size, top num_experts_per_tok of num_experts per
    # token, in layers i with (i + 1) % decoder_sparse_step == 0 outside mlp_only_layers.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The block of the projections an FP8 checkpoint keeps in FP8 (attention, MLP, MoE
        experts), None where none is kept: only block-scaled weights whose packed parts (the
        q/k/v and gate/up rows) are whole blocks and whose blocks the kernels step through are;
        the rest are dequantized as they load."""
        block = self.fp8.block if self.fp8 is not None else None
        # The matmuls step through K a block of columns at a time: a power of two, and at
        # least the 32 an fp8 tensor-core dot takes.
        if block is None or block[1] < 32 or block[1] & (block[1] - 1):
            return None
        heads = (self.num_heads, self.num_kv_heads)
        rows = [h * self.head_dim for h in heads] + [self.intermediate_size]
        rows += [self.moe_intermediate_size] if self.num_experts else []
        return block if all(r % block[0] == 0 for r in rows) else None

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE turns (all of them in Qwen3)."""
        return self.head_dim

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` has experts (transformers' rule)."""
        return (
            self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer not in self.mlp_only_layers
        )


class LayerWeights(nn.Module):
    """The weights of one Qwen3 decoder layer, under the checkpoint's names (also the DFlash
    draft's layers, which differ only in what they attend to)."""

    def __init__(self, s: Qwen3Shape, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = PagedAttention(
            s.hidden_size,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.rms_norm_eps,
            s.fp8_block,
            s.qk_norm,
        )
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoe(
                s.hidden_size,
                s.moe_intermediate_size,
                s.num_experts,
                s.num_experts_per_tok,
                s.norm_topk_prob,
                s.fp8_block,
            )
            if s.sparse(index)
            else SwiGLU(s.hidden_size, s.intermediate_size, s.fp8_block)
        )


class DecoderLayer(LayerWeights):
    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the layer's output, as
        Hugging Face defines it, is their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, positions, rope, backend, kv_cache)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Qwen3Body(nn.Module):
    def __init__(
        self,
        s: Qwen3Shape,
        layer: Callable[[Any, int], nn.Module] = DecoderLayer,  # (shape, index) -> layer
        norm: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(layer(s, i) for i in range(s.num_layers))
        self.norm = norm(s.hidden_size, s.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    # A subclass's decoder layers and final norm (the hybrid models').
    layer: ClassVar[type[nn.Module]] = DecoderLayer
    norm: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Qwen3Body(shape, self.layer, self.norm)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(
            shape.rotary_dim, shape.max_position_embeddings, shape.rope_theta, shape.rope_scaling
        )

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
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rope, backend, kv_caches[i])
            if i in capture_layers:
                captured[i] = x + residual
        features = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        return x + residual if residual is not None else x, features

    def pack_experts(self) -> None:
        """After loading: each MoE layer's experts stacked for the fused path (layers/moe.py)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.pack()

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of pre-norm hidden rows (a tensor-parallel rank's: its vocabulary
        slice's), into `out` if given."""
        head = self.lm_head(self.model.norm(hidden))
        return head.float() if out is None else out.copy_(head)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row of `logits()` (across the ranks' slices under tensor
        parallelism)."""
        return logits.argmax(dim=-1)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows of `logits()` over the whole vocabulary (gathered under tensor parallelism)."""
        return logits
