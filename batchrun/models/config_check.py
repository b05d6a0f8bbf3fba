"""Every key batchrun reads from a model's config.json, checked by type and range (the tables
below) before anything is built from it: a target's Qwen3, Qwen3-MoE, hybrid or Llama config, the
Qwen3 or Llama config of a DFlash draft's layers, and the draft's own keys in either format
(models/dflash_formats.py).

A key left out takes the default of transformers' config class for the model type (read from
the class itself), and a null one, where transformers takes null, what that class's
__post_init__ makes of it, so a checkpoint runs as transformers runs it. Keys batchrun needs and
transformers would guess (vocab_size, rope_theta, ...) are required instead.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from batchrun.errors import JobError
from batchrun.models.config_fields import Field, check_fields

INT32_MAX = 2**31 - 1  # sizes and ids: the kernels index in int32
MAX_CONTEXT = 2**24  # the rotary tables hold positions in float32, exact up to 2**24

SIZE = Field("integer", 1, INT32_MAX)
NEEDED_SIZE = Field("integer", 1, INT32_MAX, required=True)
FLAG = Field("boolean")
MAYBE_FLAG = Field("boolean", null=True)
POSITIVE = Field("number", 0, above=True)
MAYBE_SIZE = Field("integer", 1, INT32_MAX, null=True)
MAYBE_ID = Field("integer", 0, INT32_MAX, null=True)
MAYBE_BLOCK = Field("integer", 2, INT32_MAX, null=True)

COMMON = {  # both model types
    "vocab_size": NEEDED_SIZE,
    "hidden_size": NEEDED_SIZE,
    "intermediate_size": NEEDED_SIZE,
    "num_hidden_layers": NEEDED_SIZE,
    "num_attention_heads": NEEDED_SIZE,
    "num_key_value_heads": MAYBE_SIZE,  # null: num_attention_heads
    "head_dim": SIZE,
    "rms_norm_eps": POSITIVE,
    "max_position_embeddings": Field("integer", 1, MAX_CONTEXT),
    "tie_word_embeddings": FLAG,
    "rope_theta": Field("number", 1, above=True, null=True),  # wavelengths grow with it
    "rope_parameters": Field("object", null=True),
    "rope_scaling": Field("object", null=True),
    "quantization_config": Field("object", null=True),  # what is inside: models/fp8.py
    "eos_token_id": Field("integer", 0, INT32_MAX, shape="either", null=True),
    "dtype": Field("string", null=True),
    "torch_dtype": Field("string", null=True),
}
QWEN3 = COMMON | {  # and a DFlash draft's sliding windows
    "use_sliding_window": FLAG,
    "sliding_window": MAYBE_SIZE,
    "max_window_layers": Field("integer", 0, INT32_MAX),
    "layer_types": Field("string", shape="list", null=True),
}
QWEN3_MOE = COMMON | {
    "num_key_value_heads": SIZE,  # Qwen3MoeConfig takes no null
    "num_experts": SIZE,
    "num_local_experts": SIZE,  # transformers' name for num_experts, read first
    "num_experts_per_tok": SIZE,
    "moe_intermediate_size": SIZE,
    "norm_topk_prob": FLAG,
    "decoder_sparse_step": SIZE,
    "mlp_only_layers": Field("integer", 0, INT32_MAX, shape="list", null=True),
}
HYBRID = COMMON | {  # Qwen3.5's text model; the Gated DeltaNet layers' keys
    "hidden_act": Field("string"),
    "layer_types": Field("string", shape="list", null=True),
    "full_attention_interval": SIZE,
    "linear_conv_kernel_dim": Field("integer", 2, 64),
    "linear_num_key_heads": SIZE,
    "linear_num_value_heads": SIZE,
    "linear_key_head_dim": SIZE,
    "linear_value_head_dim": SIZE,
}
HYBRID_EXPERTS = {
    "num_experts": SIZE,
    "num_experts_per_tok": SIZE,
    "moe_intermediate_size": SIZE,
    "shared_expert_intermediate_size": SIZE,
}
QWEN3_NEXT = (
    HYBRID
    | HYBRID_EXPERTS
    | {
        "norm_topk_prob": FLAG,
        "decoder_sparse_step": SIZE,
        "mlp_only_layers": Field("integer", 0, INT32_MAX, shape="list", null=True),
    }
)
# Llama 3: Qwen3's layers without the q/k norm; biases and other activations are not run.
LLAMA = COMMON | {
    "head_dim": MAYBE_SIZE,  # null: hidden_size / num_attention_heads
    "hidden_act": Field("string"),
    "attention_bias": FLAG,
    "mlp_bias": FLAG,
}
NO_QK_NORM = ("llama",)  # model types whose attention has no per-head q/k RMSNorm
# Qwen3.5-MoE: every layer has experts (no dense intermediate_size), top k renormalised.
QWEN3_5_MOE = {k: f for k, f in (HYBRID | HYBRID_EXPERTS).items() if k != "intermediate_size"}
TABLES = {
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "qwen3_5_text": HYBRID,
    "qwen3_5_moe_text": QWEN3_5_MOE,
    "qwen3_next": QWEN3_NEXT,
    "llama": LLAMA,
}
LAYER_KINDS = ("linear_attention", "full_attention")
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
ROPE = {
    "rope_type": Field("string"),
    "type": Field("string"),
    "rope_theta": COMMON["rope_theta"],
    "partial_rotary_factor": Field("number", 0, 1, above=True),
}
YARN = {
    "factor": Field("number", 1, null=True, required=True),  # null: the positions' ratio
    "original_max_position_embeddings": Field("integer", 1, MAX_CONTEXT, required=True),
    # Rotations over the original context: no pair turns more often than once a position.
    "beta_fast": Field("number", 0, MAX_CONTEXT, above=True),
    "beta_slow": Field("number", 0, MAX_CONTEXT, above=True),
    "attention_factor": POSITIVE,
    "mscale": Field("number", 0),
    "mscale_all_dim": Field("number", 0),
    "truncate": FLAG,
}
LLAMA3 = {  # transformers reads each of them without a default
    "factor": Field("number", 1, required=True),
    "low_freq_factor": Field("number", 0, above=True, required=True),
    "high_freq_factor": Field("number", 0, above=True, required=True),
    "original_max_position_embeddings": Field("integer", 1, MAX_CONTEXT, required=True),
}
# A DFlash draft's own keys (models/dflash_formats.py), at the top of a z-lab config, in its
# dflash_config, and at the top of a speculators config.
ZLAB = {
    "block_size": MAYBE_BLOCK,
    "dflash_config": Field("object", null=True),
    "is_causal": MAYBE_FLAG,
    "sample_from_anchor": MAYBE_FLAG,
    "num_target_layers": MAYBE_SIZE,
    "draft_vocab_size": MAYBE_SIZE,
}
DFLASH_CONFIG = {
    "block_size": MAYBE_BLOCK,
    "mask_token_id": MAYBE_ID,
    "target_layer_ids": Field("integer", shape="list", null=True),  # the target's: check_draft
    "causal": MAYBE_FLAG,
    "sample_from_anchor": MAYBE_FLAG,
}
SPECULATORS = {
    "speculators_model_type": Field("string"),
    "projector_type": Field("string"),
    "transformer_layer_config": Field("object", null=True),
    "block_size": MAYBE_BLOCK,
    "mask_token_id": MAYBE_ID,
    "draft_vocab_size": MAYBE_SIZE,
    "aux_hidden_state_layer_ids": Field("integer", shape="list", null=True),
    "target_hidden_size": MAYBE_SIZE,
    "sample_from_anchor": MAYBE_FLAG,
    "shift_label": MAYBE_FLAG,
    "sliding_window_non_causal": MAYBE_FLAG,
}


def checked_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keys of the model type's table, checked, as transformers reads them: its defaults
    for those left out (none where it has none), plus rope_theta, `rope_scaling` (the checked
    YaRN or llama3 parameters with their rope_type; None: plain RoPE) and `qk_norm` (whether
    the attention norms q and k). JobError, naming `where` (the file) and the key, for the
    first key that is wrong."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in TABLES:
        raise JobError(f"{where}: model_type is {model_type!r}; batchrun runs {', '.join(TABLES)}")
    table = TABLES[model_type]
    check_fields(config, table, where, model_type)
    aliases = _attribute_map(model_type)
    defaults = _defaults(model_type)
    settings: dict[str, Any] = {}
    for key in (k for k in table if k not in aliases.values()):
        stored = aliases.get(key, key)  # transformers keeps num_experts as num_local_experts
        if stored in config or key in config:
            settings[key] = config[stored] if stored in config else config[key]
        elif key in defaults:
            settings[key] = defaults[key]
    _post_init(settings, model_type)
    _check_shape(settings, where, model_type)
    settings["rope_theta"], settings["rope_scaling"] = _rope(config, settings, where, model_type)
    settings["qk_norm"] = model_type not in NO_QK_NORM
    if model_type in HYBRID_TYPES:
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        # transformers' default for Qwen3.5 and Qwen3-Next (their __post_init__)
        settings["partial_rotary_factor"] = params.get(
            "partial_rotary_factor", config.get("partial_rotary_factor", 0.25)
        )
    return settings


def _post_init(s: dict[str, Any], model_type: str) -> None:
    """What transformers makes of a null or missing key beyond its class defaults: Qwen3Config's
    and Qwen3MoeConfig's __post_init__, Qwen3-MoE attention's head_dim, and the hybrid configs'
    layer_types (every full_attention_interval-th layer full) and fixed MoE rules."""
    if model_type in HYBRID_TYPES:
        if s["num_key_value_heads"] is None:
            s["num_key_value_heads"] = s["num_attention_heads"]
        if s.get("layer_types") is None:
            interval = s.pop("full_attention_interval", None) or 4
            s["layer_types"] = [
                "linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(s["num_hidden_layers"])
            ]
        s.pop("full_attention_interval", None)
        if model_type == "qwen3_5_moe_text":
            s.update(intermediate_size=0, norm_topk_prob=True, decoder_sparse_step=1)
        if "num_experts" in s:
            s["mlp_only_layers"] = s.get("mlp_only_layers") or []
        return
    if model_type == "llama":
        if s["head_dim"] is None:
            s["head_dim"] = s["hidden_size"] // s["num_attention_heads"]
        if s["num_key_value_heads"] is None:
            s["num_key_value_heads"] = s["num_attention_heads"]
        return
    if model_type == "qwen3_moe":
        s.setdefault("head_dim", s["hidden_size"] // s["num_attention_heads"])
        s["mlp_only_layers"] = s["mlp_only_layers"] or []
        return
    if s["num_key_value_heads"] is None:
        s["num_key_value_heads"] = s["num_attention_heads"]
    if not s["use_sliding_window"]:
        s["sliding_window"] = None
    if s["layer_types"] is None:
        s["layer_types"] = [
            "sliding_attention"
            if s["sliding_window"] is not None and i >= s["max_window_layers"]
            else "full_attention"
            for i in range(s["num_hidden_layers"])
        ]


def _check_shape(s: Mapping[str, Any], where: str, model_type: str) -> None:
    """The ranges that depend on other keys."""
    heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
    if heads % kv_heads:
        raise JobError(
            f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
        )
    if s["head_dim"] % 2:
        raise JobError(f"{where}: head_dim must be even (RoPE turns pairs), got {s['head_dim']}")
    if model_type in HYBRID_TYPES:
        _check_hybrid(s, where)
    if model_type == "llama":
        _check_llama(s, where)
    if "num_experts" not in s:
        return
    experts, top_k = s["num_experts"], s["num_experts_per_tok"]
    if top_k > experts:
        raise JobError(
            f"{where}: num_experts_per_tok must be in [1, num_experts = {experts}], got {top_k}"
        )
    layers = s["num_hidden_layers"]
    outside = [i for i in s["mlp_only_layers"] if i >= layers]
    if outside:
        raise JobError(
            f"{where}: mlp_only_layers names layer {outside[0]}; the model has {layers} (0 .. "
            f"{layers - 1})"
        )


def _check_hybrid(s: Mapping[str, Any], where: str) -> None:
    """The Gated DeltaNet layers' ranges: layer_types one known kind per layer, value heads a
    multiple of key heads, SiLU."""
    kinds, layers = s["layer_types"], s["num_hidden_layers"]
    if len(kinds) != layers:
        raise JobError(
            f"{where}: layer_types has {len(kinds)} entries; num_hidden_layers is {layers}"
        )
    odd = [kind for kind in kinds if kind not in LAYER_KINDS]
    if odd:
        raise JobError(f"{where}: layer_types holds {odd[0]!r}; batchrun runs {LAYER_KINDS}")
    keys, values = s["linear_num_key_heads"], s["linear_num_value_heads"]
    if values % keys:
        raise JobError(
            f"{where}: linear_num_key_heads {keys} does not divide linear_num_value_heads {values}"
        )
    if s.get("hidden_act", "silu") != "silu":
        raise JobError(f"{where}: hidden_act is {s['hidden_act']!r}; batchrun runs silu")


def _check_llama(s: Mapping[str, Any], where: str) -> None:
    """What Llama's config may switch on that batchrun's layers do not compute."""
    for key in ("attention_bias", "mlp_bias"):
        if s[key]:
            raise JobError(f"{where}: {key} is true; batchrun runs Llama without biases")
    if s["hidden_act"] != "silu":
        raise JobError(f"{where}: hidden_act is {s['hidden_act']!r}; batchrun runs silu")


def _rope(
    config: Mapping[str, Any], s: Mapping[str, Any], where: str, model_type: str
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the YaRN or llama3 parameters with their rope_type, or None), read as
    transformers reads them: rope_scaling over rope_parameters, and a theta among them over a
    rope_theta beside them."""
    source = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(source) or {}
    check_fields(params, ROPE, where, "rope", f"{source}.")
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise JobError(f"{where}: {model_type} needs rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        check_fields(params, LLAMA3, where, "llama3", f"{source}.")
        return float(theta), {"rope_type": kind} | {key: params[key] for key in LLAMA3}
    if kind != "yarn":
        raise JobError(f"{where}: rope type {kind!r} is not supported (plain RoPE, yarn or llama3)")
    check_fields(params, YARN, where, "yarn", f"{source}.")
    yarn = {key: params[key] for key in YARN if params.get(key) is not None}
    original = yarn["original_max_position_embeddings"]
    factor = yarn.setdefault("factor", s["max_position_embeddings"] / original)
    if factor < 1:
        raise JobError(
            f"{where}: {source}.factor is null and max_position_embeddings / "
            f"original_max_position_embeddings is {factor:g}; yarn needs a factor >= 1"
        )
    if factor * original > MAX_CONTEXT:
        raise JobError(
            f"{where}: {source}.factor {factor:g} x original_max_position_embeddings {original} "
            f"is more than the {MAX_CONTEXT} positions batchrun addresses"
        )
    return float(theta), {"rope_type": kind} | yarn


@functools.cache
def _defaults(model_type: str) -> Mapping[str, Any]:
    """The defaults of transformers' config class for model_type, by key."""
    fields = dataclasses.fields(_config_class(model_type))
    return MappingProxyType(
        {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    )


@functools.cache
def _attribute_map(model_type: str) -> Mapping[str, str]:
    """Keys transformers' config class stores under another name (num_experts ->
    num_local_experts): config.json's stored name wins where both are there."""
    return MappingProxyType(dict(_config_class(model_type).attribute_map))


def _config_class(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def check_transformers_reads(config: Mapping[str, Any], where: str) -> None:
    """JobError where transformers' config class refuses config.json (a type its fields do not
    take, on keys batchrun does not read): transformers reads the target's config to load its
    tokenizer, and the error is the config's, not the tokenizer's."""
    try:
        _config_class(str(config["model_type"])).from_dict(copy.deepcopy(dict(config)))
    except Exception as e:  # transformers' validation raises several error types
        message = " ".join(str(e).split())
        raise JobError(f"{where}: transformers does not read it: {message}") from None
