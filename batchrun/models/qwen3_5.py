"""The hybrid Gated DeltaNet targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as one causal LM:
layer_types picks each layer's token mixer, a Gated DeltaNet (layers/linear_attention.py: its
state in per-request slots) or gated full attention over the paged KV cache
(layers/gated_attention.py); the feed-forward is a SwiGLU or experts with a shared expert.

Module names mirror the text model's checkpoint names ("model.layers.0.linear_attn.out_proj",
...), packed as Qwen3's are (`PACKED`). The forward contract is Qwen3ForCausalLM's, plus the
linear layers' step meta; `commit_linear` finishes a verify step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.layers.gated_attention import GatedAttention
from batchrun.layers.linear_attention import GatedDeltaNet, LinearLayerState, LinearStepMeta
from batchrun.layers.mlp import SwiGLU
from batchrun.layers.moe import SharedExpertMoe
from batchrun.layers.norm import ZeroCentredRMSNorm
from batchrun.layers.ops import KeptRows
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape

LINEAR, FULL = "linear_attention", "full_attention"
_INDEX = torch.int32  # KeptRows' count and buffer
# A layer's cache: (K, V) pages for full attention, its state for a linear layer.
LayerCache = tuple[torch.Tensor, torch.Tensor] | LinearLayerState


@dataclass(frozen=True)
class Qwen3_5Shape(Qwen3Shape):
    layer_types: tuple[str, ...] = ()  # LINEAR or FULL, one per layer
    partial_rotary_factor: float = 1.0
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    shared_expert_intermediate_size: int = 0  # with num_experts: each MoE block's shared expert

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """A linear layer's q (and k) channels: its key heads'."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def conv_dim(self) -> int:
        """A linear layer's conv channels: q and k (key heads), then v (value heads)."""
        return 2 * self.linear_key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR)

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        block = super().fp8_block
        shared = self.shared_expert_intermediate_size if self.num_experts else 0
        return None if block is None or shared % block[0] else block


def linear_state_bytes(shape: Qwen3_5Shape, dtype: torch.dtype) -> int:
    """The bytes one request's slot takes over all linear layers (conv and recurrent state),
    what memory sizing sets against KV pages; what a verify keeps (allocate_linear_states) is
    per verify row, not per slot."""
    conv = shape.conv_dim * (shape.linear_conv_kernel - 1) * dtype.itemsize
    heads = shape.linear_num_value_heads
    recurrent = heads * shape.linear_key_head_dim * shape.linear_value_head_dim * 4
    return len(shape.linear_layers) * (conv + recurrent)


def _kept_row_bytes(shape: Qwen3_5Shape, dtype: torch.dtype) -> tuple[int, int]:
    """(one verify row's pre-conv qkv, its staged k, v, g and beta), in one linear layer."""
    kv_dim = shape.conv_dim - shape.linear_key_dim
    staged = kv_dim * dtype.itemsize + 2 * shape.linear_num_value_heads * 4
    return shape.conv_dim * dtype.itemsize, staged


def linear_verify_row_bytes(shape: Qwen3_5Shape, dtype: torch.dtype) -> int:
    """What one verify row keeps over all linear layers for the commit (its pre-conv row, and
    what the slot's recurrent state takes in its next step): each is written once and read at
    most once."""
    return len(shape.linear_layers) * sum(_kept_row_bytes(shape, dtype))


def linear_scratch_bytes(shape: Qwen3_5Shape, dtype: torch.dtype) -> int:
    """What allocate_linear_states holds per verify row of one decode slot over all linear
    layers: the pre-conv row, and the staged rows of both KeptRows buffers."""
    pre_conv, staged = _kept_row_bytes(shape, dtype)
    return len(shape.linear_layers) * (pre_conv + 2 * staged)


def linear_kept_bytes(
    shape: Qwen3_5Shape, dtype: torch.dtype, decode_slots: int, max_width: int
) -> int:
    """What allocate_linear_states holds beside the state slots: each decode slot's rows of up
    to max_width, and KeptRows' count and buffer (shared by the layers)."""
    return decode_slots * (max_width * linear_scratch_bytes(shape, dtype) + 2 * _INDEX.itemsize)


def allocate_linear_states(
    shape: Qwen3_5Shape,
    num_slots: int,
    decode_slots: int,
    max_width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[int, LinearLayerState]:
    """Zeroed states by layer index: num_slots state slots, of which the first decode_slots
    may decode or verify up to max_width rows a step (the rest restore prefixes)."""
    heads, dk, dv = (
        shape.linear_num_value_heads,
        shape.linear_key_head_dim,
        shape.linear_value_head_dim,
    )
    kv_dim = shape.conv_dim - shape.linear_key_dim

    def zeros(*size: int, kind: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(size, dtype=kind, device=device)

    # Shared by every layer: a slot's rows pending are the same rows in each.
    count, buffer = zeros(decode_slots, kind=_INDEX), zeros(decode_slots, kind=_INDEX)
    staged = (decode_slots, 2, max_width)
    return {
        i: LinearLayerState(
            conv=zeros(num_slots, shape.conv_dim, shape.linear_conv_kernel - 1, kind=dtype),
            recurrent=zeros(num_slots, heads, dk, dv),
            scratch_qkv=zeros(decode_slots * max_width, shape.conv_dim, kind=dtype),
            kept=KeptRows(
                count,
                buffer,
                kv=zeros(*staged, kv_dim, kind=dtype),
                g=zeros(*staged, heads),
                beta=zeros(*staged, heads),
            ),
        )
        for i in shape.linear_layers
    }


class HybridLayer(nn.Module):
    """One decoder layer: its token mixer (linear_attn or self_attn, the checkpoint's names),
    then the feed-forward, each behind a zero-centred RMSNorm."""

    def __init__(self, s: Qwen3_5Shape, index: int) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(s.hidden_size, s.rms_norm_eps)
        if s.layer_types[index] == LINEAR:
            self.linear_attn = GatedDeltaNet(
                s.hidden_size,
                s.linear_num_key_heads,
                s.linear_num_value_heads,
                s.linear_key_head_dim,
                s.linear_value_head_dim,
                s.linear_conv_kernel,
                s.rms_norm_eps,
            )
        else:
            self.self_attn = GatedAttention(
                s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, s.fp8_block
            )
        self.mlp: nn.Module = (
            SharedExpertMoe(
                s.hidden_size,
                s.moe_intermediate_size,
                s.num_experts,
                s.num_experts_per_tok,
                s.norm_topk_prob,
                s.shared_expert_intermediate_size,
                s.fp8_block,
            )
            if s.sparse(index)
            else SwiGLU(s.hidden_size, s.intermediate_size, s.fp8_block)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        cache: LayerCache,
        meta: LinearStepMeta | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it), as Qwen3's layers."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        if isinstance(cache, LinearLayerState):
            assert meta is not None, "a linear layer needs the step's LinearStepMeta"
            h = self.linear_attn(h, cache, meta)
        else:
            h = self.self_attn(h, positions, rope, backend, cache)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Qwen3_5ForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM's interface (logits, argmax, pack_experts, ...) over hybrid layers."""

    layer = HybridLayer
    norm = ZeroCentredRMSNorm
    shape: Qwen3_5Shape

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[LayerCache],
        capture_layers: tuple[int, ...] = (),
        linear: LinearStepMeta | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Qwen3ForCausalLM.forward's (pre-norm residual stream [T, H], captured features).
        kv_caches[i]: (K, V) of a full-attention layer, the LinearLayerState of a linear one
        (allocate_linear_states); `linear` says how the step's rows map to their slots
        (required when the model has linear layers). After a verify step, call
        commit_linear."""
        x = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rope, backend, kv_caches[i], linear)
            if i in capture_layers:
                captured[i] = x + residual
        features = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        if linear is not None and self.shape.linear_layers:  # each layer read the pending rows
            self._kept_rows(kv_caches).clear(linear.slots)
        return x + residual if residual is not None else x, features

    def _kept_rows(self, kv_caches: list[LayerCache]) -> KeptRows:
        """The linear layers' KeptRows (their counts and buffers are shared)."""
        state = kv_caches[self.shape.linear_layers[0]]
        assert isinstance(state, LinearLayerState)
        return state.kept

    def commit_linear(
        self, kv_caches: list[LayerCache], meta: LinearStepMeta, accepted: torch.Tensor
    ) -> None:
        """After a verify step's acceptance (accepted [meta.decoding] int64 on the device:
        drafts accepted, so rows 0 .. accepted[r] of request r are kept): every linear layer's
        slots carry their kept rows' conv inputs, and their recurrent states take the kept rows
        at the start of their next step. A no-op after steps that verify nothing."""
        if not meta.verify:
            return
        kept = accepted + 1
        for i in self.shape.linear_layers:
            state = kv_caches[i]
            layer = self.model.layers[i]
            assert isinstance(state, LinearLayerState) and isinstance(layer, HybridLayer)
            layer.linear_attn.commit(state, meta, kept)
        self._kept_rows(kv_caches).take(meta.slots[: meta.decoding], kept)
