"""The DFlash drafter (docs/dflash.md section 3): a few Qwen3-shaped layers whose block queries see
the context K/V computed from target features plus the block's own K/V: without a mask in the
z-lab drafts; sliding-window layers see only the positions in their window, and a layer may be
causal inside the block (models/block_attention.py).

It has no embedding: it borrows the target's. Nor an lm_head, unless it drafts from a reduced
vocabulary: then its own head scores draft_vocab_size tokens and `draft_to_target` maps each to
its target id. A draft forward is two calls: `write_context` stores the K/V of newly committed
tokens (a variable number of rows, run eagerly), and `draft_block` drafts a block per request
(a fixed shape, captured in CUDA graphs). Full-attention and sliding layers keep their context
in different caches and attend through different planned backends: each call takes both and
uses, per layer, the one of its kind.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.attention import PagedAttention
from batchrun.layers.norm import RMSNorm
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.block_attention import BlockAttention
from batchrun.models.qwen3 import LayerWeights, Qwen3ForCausalLM, Qwen3Shape


def default_target_layer_ids(num_draft_layers: int, num_target_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * span) for i in range(num_draft_layers)]


class DraftLayer(LayerWeights):
    def forward(
        self,
        x: torch.Tensor,  # block rows
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn.qkv(self.input_layernorm(x), positions, rope)
        backend.write_kv(k, v, kv_cache[0], kv_cache[1])
        x = x + attn.attend(q, backend, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    def __init__(
        self,
        shape: Qwen3Shape,
        target_layer_ids: list[int],
        block_size: int,
        mask_token_id: int,
        max_positions: int,
        attention: BlockAttention | None = None,
        draft_vocab_size: int | None = None,
    ) -> None:
        """draft_vocab_size: the draft has its own lm_head of that many rows (None: it uses the
        target's), whose tokens draft_to_target maps to target ids where it is set."""
        super().__init__()
        self.shape = shape
        self.target_layer_ids = tuple(target_layer_ids)
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.attention = attention or BlockAttention.full(shape.num_layers)
        if len(self.attention.sliding) != shape.num_layers:
            raise ValueError(f"{len(self.attention.sliding)} layer kinds for {shape.num_layers}")
        h = shape.hidden_size
        self.fc = nn.Linear(len(target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, shape.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.rope = RotaryEmbedding(
            shape.head_dim, max_positions, shape.rope_theta, shape.rope_scaling
        )
        self.context_kv: torch.Tensor | None = None  # set by pack_context_kv() once loaded
        self.lm_head: nn.Linear | None = None
        if draft_vocab_size is not None:
            self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.draft_to_target: torch.Tensor | None = None  # [draft_vocab_size] target ids

    def pack_context_kv(self) -> None:
        """One [layers * 2 * kv_size, H] weight: every layer's context K/V in one matmul.
        Call it once the weights are in place (the loaders do)."""
        rows = []
        for layer in self.layers:
            attn = cast(PagedAttention, layer.self_attn)
            rows.append(attn.qkv_proj.weight[attn.q_size :])  # k then v
        self.context_kv = torch.cat(rows).detach()

    def write_context(
        self,
        features: torch.Tensor,  # [C, n * H] target features of newly committed tokens
        positions: torch.Tensor,  # [C]
        kv_index: torch.Tensor,  # [C] the full-attention layers' cache index of each row
        window_kv_index: torch.Tensor | None,  # [C] the sliding layers' (in their ring)
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Context rows feed only each layer's K/V (norm then RoPE): no residual, no MLP."""
        if features.shape[0] == 0:
            return
        assert self.context_kv is not None, "pack_context_kv() after loading the weights"
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        kv = nn.functional.linear(ctx, self.context_kv)
        kv_size = self.shape.num_kv_heads * self.shape.head_dim
        layers = zip(self.layers, kv_caches, self.attention.sliding, strict=True)
        for i, (layer, cache, sliding) in enumerate(layers):
            attn = cast(PagedAttention, layer.self_attn)
            k = kv[:, 2 * i * kv_size : (2 * i + 1) * kv_size]
            v = kv[:, (2 * i + 1) * kv_size : (2 * i + 2) * kv_size]
            k = attn.rotate_keys(k, positions, self.rope)
            layer_kv_index = window_kv_index if sliding else kv_index
            assert layer_kv_index is not None, "a sliding layer's context goes to its ring"
            backend.write_kv(k, v.reshape_as(k), cache[0], cache[1], layer_kv_index)

    def draft_block(
        self,
        target: Qwen3ForCausalLM,
        block_ids: torch.Tensor,  # [R * B] per drafting request: its anchor, then B-1 masks
        positions: torch.Tensor,  # [R * B] block positions p .. p+B-1 per request
        backend: AttentionBackend,  # planned for the full-attention layers' blocks
        window_backend: AttentionBackend | None,  # planned for the sliding layers' (windowed)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The drafted target tokens [R, B-1]: the argmax of rows 1 .. B-1 through the draft's
        head (the target's, or its own mapped to target ids)."""
        rows = self.block_rows(target, block_ids, positions, backend, window_backend, kv_caches)
        if self.lm_head is None:  # the target's head: its argmax (across tensor-parallel ranks)
            return target.argmax(target.lm_head(rows))
        drafts = self.lm_head(rows).argmax(dim=-1)
        return drafts if self.draft_to_target is None else self.draft_to_target[drafts]

    def block_rows(
        self,
        target: Qwen3ForCausalLM,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        window_backend: AttentionBackend | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The final-normed block rows 1 .. B-1 [R, B-1, H] (draft_block's arguments), which
        the head scores."""
        x = target.model.embed_tokens(block_ids)
        kinds = self.attention.sliding
        for layer, cache, sliding in zip(self.layers, kv_caches, kinds, strict=True):
            layer_backend = window_backend if sliding else backend
            assert layer_backend is not None, "a sliding layer attends through its own backend"
            x = layer(x, positions, self.rope, layer_backend, cache)
        rows = x.view(x.shape[0] // self.block_size, self.block_size, x.shape[-1])[:, 1:]
        return self.norm(rows)
