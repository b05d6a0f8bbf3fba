"""The drafter as it is trained: the frozen target's features, and a forward that drafts many
blocks per sequence at once (docs/dflash.md section 3, with a mask per block)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def load_frozen_target(target_dir: Path, device: torch.device) -> Qwen3ForCausalLM:
    """The target in float32 (autocast computes in bf16 on CUDA), with no gradients."""
    target = Qwen3ForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    return target.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]


def draft_model_config(
    target: Qwen3ForCausalLM, num_layers: int, intermediate_size: int | None = None
) -> Qwen3Config:
    """The target's widths, norms and RoPE with the draft's own depth (and MLP width)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    config.intermediate_size = intermediate_size or config.intermediate_size
    config.layer_types = ["full_attention"] * num_layers
    return config


@contextmanager
def captured_layers(
    target: Qwen3ForCausalLM, layer_ids: list[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """Capture each listed decoder layer's OUTPUT: HF's hidden_states[l + 1], but pre-norm also
    for the last layer, where HF's last hidden state has the final norm applied."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    hooks = [target.model.layers[i].register_forward_hook(hook_for(i)) for i in set(layer_ids)]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def target_features(
    target: Qwen3ForCausalLM, ids: torch.Tensor, layer_ids: list[int]
) -> torch.Tensor:
    """f = concat of the listed layers' outputs [N, T, n * H]. Right padding needs no mask:
    the target is causal, so padding changes no earlier position."""
    with captured_layers(target, layer_ids) as captured:
        target.model(input_ids=ids, use_cache=False)
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


# ---- the draft ----


class TrainableDraft(nn.Module):
    """The draft's weights under the z-lab names (fc, hidden_norm, layers.i.*, norm), with a
    training forward that drafts many blocks per sequence at once."""

    def __init__(self, config: Qwen3Config, num_features: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(num_features * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)  # non-persistent buffers: not saved
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    def forward(
        self,
        features: torch.Tensor,  # [N, T, n * H] target features of every position
        block_embeds: torch.Tensor,  # [N, Q, H] target embeddings of [anchor, MASK, ...] per block
        block_positions: torch.Tensor,  # [N, Q]
        mask: torch.Tensor,  # [N, 1, Q, T + Q] bool, True where a block row may attend
    ) -> torch.Tensor:
        """The final-normed block rows [N, Q, H]."""
        n, t = features.shape[:2]
        ctx = self.hidden_norm(self.fc(features))
        ctx_positions = torch.arange(t, device=features.device).expand(n, t)
        ctx_rope = self.rotary(ctx, ctx_positions)
        blk_rope = self.rotary(block_embeds, block_positions)
        x = block_embeds
        for layer in self.layers:
            x = self._layer(cast(Qwen3DecoderLayer, layer), x, ctx, blk_rope, ctx_rope, mask)
        return self.norm(x)

    @staticmethod
    def _layer(
        layer: Qwen3DecoderLayer,
        x: torch.Tensor,
        ctx: torch.Tensor,
        blk_rope: tuple[torch.Tensor, torch.Tensor],
        ctx_rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """docs/dflash.md section 3: context rows only feed this layer's k/v (norm then RoPE),
        with no layernorm, residual or MLP of their own; block rows are a normal pre-norm
        layer."""
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = _heads(attn.q_norm(_split(attn.q_proj(h), attn.head_dim)), blk_rope)
        k_blk = _heads(attn.k_norm(_split(attn.k_proj(h), attn.head_dim)), blk_rope)
        k_ctx = _heads(attn.k_norm(_split(attn.k_proj(ctx), attn.head_dim)), ctx_rope)
        v_blk = _split(attn.v_proj(h), attn.head_dim).transpose(1, 2)
        v_ctx = _split(attn.v_proj(ctx), attn.head_dim).transpose(1, 2)
        groups = attn.num_key_value_groups
        k = torch.cat([k_ctx, k_blk], dim=2).repeat_interleave(groups, dim=1)
        v = torch.cat([v_ctx, v_blk], dim=2).repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        x = x + attn.o_proj(o.transpose(1, 2).flatten(2))
        return x + layer.mlp(layer.post_attention_layernorm(x))


def _split(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(*x.shape[:-1], -1, head_dim)


def _heads(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[N, T, heads, d] -> RoPE (rotate-half) -> [N, heads, T, d]."""
    cos, sin = (c.unsqueeze(2) for c in rope)
    return (x * cos + rotate_half(x) * sin).transpose(1, 2)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[N, 1, K*B, T + K*B]: block k's rows see context positions < p_k and block k only."""
    n, k = anchors.shape
    ctx_ok = torch.arange(context_len, device=anchors.device) < anchors[:, :, None]  # [N, K, T]
    block_of = torch.arange(k * block_size, device=anchors.device) // block_size
    same = block_of[:, None] == block_of[None, :]  # [KB, KB]
    rows = torch.cat([ctx_ok.repeat_interleave(block_size, dim=1), same.expand(n, -1, -1)], dim=2)
    return rows[:, None]


def draft_logits(
    draft: TrainableDraft,
    target: Qwen3ForCausalLM,
    features: torch.Tensor,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    mask_id: int,
    block_size: int,
) -> torch.Tensor:
    """Logits [N, K, B-1, V] of rows 1 .. B-1 of every block, through the target's lm_head."""
    n, k = anchors.shape
    block = torch.full((n, k, block_size), mask_id, dtype=torch.long, device=ids.device)
    block[:, :, 0] = ids.gather(1, anchors)
    positions = anchors[:, :, None] + torch.arange(block_size, device=ids.device)
    embeds = target.model.embed_tokens(block.flatten(1))
    mask = block_attention_mask(anchors, features.shape[1], block_size)
    hidden = draft(features, embeds, positions.flatten(1), mask)
    rows = hidden.view(n, k, block_size, -1)[:, :, 1:]
    return target.lm_head(rows)


def block_labels(
    ids: torch.Tensor, lens: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's tokens at p+1 .. p+B-1 [N, K, B-1], and which of them exist."""
    positions = anchors[:, :, None] + torch.arange(1, width, device=ids.device)
    labels = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(positions)
    exists = (positions < lens[:, None, None]) & valid[:, :, None]
    return labels, exists
