"""Model shapes from checked config settings (config_check.checked_config's): Qwen3, Qwen3-MoE
and Llama, and the hybrid Gated DeltaNet models on top of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchrun.errors import JobError
from batchrun.layers.rotary import Llama3, RopeScaling, Yarn
from batchrun.models.fp8 import fp8_scheme
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.models.qwen3_5 import Qwen3_5Shape


def shape_of(settings: Mapping[str, Any], what: str) -> Qwen3Shape:
    """The model checked_config's settings describe."""
    if what == "target" and "sliding_attention" in (settings.get("layer_types") or ()):
        # transformers would attend through a window in those layers; the target's attention
        # is full, so its outputs would differ from the model's.
        raise JobError(f"{what}: sliding-window attention layers are not supported in a target")
    scaling = _rope_scaling(settings["rope_scaling"])
    yarn = scaling if isinstance(scaling, Yarn) else None
    return Qwen3Shape(
        vocab_size=settings["vocab_size"],
        hidden_size=settings["hidden_size"],
        intermediate_size=settings["intermediate_size"],
        num_layers=settings["num_hidden_layers"],
        num_heads=settings["num_attention_heads"],
        num_kv_heads=settings["num_key_value_heads"],
        head_dim=settings["head_dim"],
        rms_norm_eps=float(settings["rms_norm_eps"]),
        rope_theta=settings["rope_theta"],
        # With YaRN the context is factor x original (as vLLM derives it).
        max_position_embeddings=max(
            settings["max_position_embeddings"], yarn.context if yarn else 0
        ),
        tie_word_embeddings=settings["tie_word_embeddings"],
        rope_scaling=scaling,
        qk_norm=settings["qk_norm"],
        fp8=fp8_scheme(settings, what),
        **_moe_fields(settings),
    )


def _rope_scaling(params: Mapping[str, Any] | None) -> RopeScaling | None:
    """checked_config's YaRN or llama3 parameters as the rotary tables take them."""
    if params is None:
        return None
    if params["rope_type"] == "llama3":
        return Llama3(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=params["original_max_position_embeddings"],
        )
    numbers = ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
    given: dict[str, Any] = {key: float(params[key]) for key in numbers if key in params}
    if "truncate" in params:
        given["truncate"] = params["truncate"]
    return Yarn(
        original_max_position_embeddings=params["original_max_position_embeddings"], **given
    )


def _moe_fields(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's keys as Qwen3Shape's fields (none for a dense model)."""
    if "num_experts" not in settings:
        return {}
    return {
        "num_experts": settings["num_experts"],
        "num_experts_per_tok": settings["num_experts_per_tok"],
        "moe_intermediate_size": settings["moe_intermediate_size"],
        "norm_topk_prob": settings["norm_topk_prob"],
        "decoder_sparse_step": settings["decoder_sparse_step"],
        "mlp_only_layers": tuple(settings["mlp_only_layers"]),
    }


def hybrid_shape(settings: Mapping[str, Any], what: str) -> Qwen3_5Shape:
    """The hybrid model checked_config's settings describe (qwen3_5_text, qwen3_5_moe_text,
    qwen3_next)."""
    return Qwen3_5Shape(
        **vars(shape_of(settings, what)),
        layer_types=tuple(settings["layer_types"]),
        partial_rotary_factor=float(settings["partial_rotary_factor"]),
        linear_conv_kernel=settings["linear_conv_kernel_dim"],
        linear_num_key_heads=settings["linear_num_key_heads"],
        linear_num_value_heads=settings["linear_num_value_heads"],
        linear_key_head_dim=settings["linear_key_head_dim"],
        linear_value_head_dim=settings["linear_value_head_dim"],
        shared_expert_intermediate_size=settings.get("shared_expert_intermediate_size", 0),
    )
