"""The DFlash drafter (dflash.md section 3): a few Qwen3-shaped layers whose block queries see,
without a mask, the context K/V computed from target features plus the block's own K/V.

It has no embedding and no lm_head: it borrows the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.layers.attention import AttentionBackend
from batchrun.layers.norm import RMSNorm
from batchrun.layers.rotary import RotaryEmbedding
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
        ctx: torch.Tensor,  # context rows: no layernorm, no residual, only this layer's K/V
        ctx_positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = rope(attn.q_norm(attn.q_proj(h).view(-1, attn.num_heads, attn.head_dim)), positions)
        k_ctx, v_ctx = attn.project_kv(ctx, ctx_positions, rope)
        k_blk, v_blk = attn.project_kv(h, positions, rope)
        # Row order matches the planned slot mapping: every context row, then every block row.
        k, v = torch.cat((k_ctx, k_blk)), torch.cat((v_ctx, v_blk))
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn.scale)
        x = x + attn.o_proj(out.reshape(x.shape[0], attn.num_heads * attn.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    def __init__(
        self,
        shape: Qwen3Shape,
        target_layer_ids: list[int],
        block_size: int,
        mask_token_id: int,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.target_layer_ids = tuple(target_layer_ids)
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        h = shape.hidden_size
        self.fc = nn.Linear(len(target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, shape.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.rope = RotaryEmbedding(shape.head_dim, max_positions, shape.rope_theta)

    def forward(
        self,
        target: Qwen3ForCausalLM,
        block_ids: torch.Tensor,  # [R * B] per drafting request: its anchor, then B-1 masks
        positions: torch.Tensor,  # [R * B] block positions p .. p+B-1 per request
        features: torch.Tensor,  # [C, n * H] target features of the new context tokens
        ctx_positions: torch.Tensor,  # [C]
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Writes the new context K/V and returns the drafted tokens [R, B-1] (argmax)."""
        x = target.model.embed_tokens(block_ids)
        ctx = self.hidden_norm(self.fc(features.to(x.dtype)))
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, ctx, ctx_positions, self.rope, backend, cache)
        rows = x.view(x.shape[0] // self.block_size, self.block_size, x.shape[-1])[:, 1:]
        logits = target.lm_head(self.norm(rows))
        return logits.argmax(dim=-1)
