"""The two formats of a DFlash draft's config.json, read into one description.

z-lab (docs/dflash.md section 1): a Qwen3 config (a Llama one for Llama-style layers, without
the q/k norm) with `block_size` and `dflash_config` (`target_layer_ids`, the 0-based target
layers whose output is a feature, and `mask_token_id`).

speculators (vllm-project/speculators, `speculators_model_type: "dflash"`): the draft's Qwen3
config under `transformer_layer_config`, written as transformers' diff dict (keys equal to
Qwen3Config's defaults may be left out, so they are filled in from it); `block_size`,
`mask_token_id` and `draft_vocab_size` at the top level; `aux_hidden_state_layer_ids`, which
count Hugging Face hidden states (index 0 is the embedding output), so the output of target layer
l is aux id l + 1. The tensors are the z-lab names, plus the verifier's own that a checkpoint may
carry as copies (they are not loaded: the target's are used).

Either may draft from a reduced vocabulary (`draft_vocab_size`, an `lm_head` of that many rows
and the `d2t` map) and have sliding-window layers (`layer_types`). Which layers are causal inside
the block, as vLLM and speculators resolve it: in the z-lab format `is_causal`, else
`dflash_config.causal`, for every layer, else only the sliding layers; in the speculators format
the sliding layers, unless `sliding_window_non_causal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.errors import JobError
from batchrun.models.config_check import DFLASH_CONFIG, SPECULATORS, ZLAB
from batchrun.models.config_fields import check_fields


@dataclass(frozen=True)
class DraftConfig:
    """What a draft's config.json says, in either format, under one set of names: each key
    checked by type and range, not yet against the target (check_draft)."""

    format: str  # "z-lab" or "speculators"
    layers: dict[str, Any]  # the draft's own Qwen3 config: shape, layer types, window
    layers_where: str  # where those keys are, for errors: "draft: /d/config.json"
    block_size: Any
    mask_token_id: Any
    layer_ids: Any  # the target layers whose outputs are features, as the config counts them
    layer_ids_key: str  # the config key that lists them (None under it: derive them)
    layer_id_base: int  # the id of target layer 0's output in that count
    num_target_layers: Any  # what default ids are derived for (None: the target's)
    draft_vocab_size: Any  # None: the target's vocabulary
    full_causal: bool
    sliding_causal: bool
    verifier_tensors: frozenset[str] = frozenset()  # copies of the target's, never loaded


# The layers a z-lab draft's model_type names: Qwen3's, or Llama's (no q/k norm; the drafter of
# Llama 3.1).
DRAFT_LAYERS = ("qwen3", "llama")


ZLAB_ARCHITECTURE = "DFlashDraftModel"


def draft_config(
    config: dict[str, Any], where: str, architecture: str = ZLAB_ARCHITECTURE
) -> DraftConfig:
    """Reads either format, its own keys checked by type and range (config_check's tables);
    refuses, by name, what batchrun does not implement. where: the file, for errors;
    architecture: the z-lab config's `architectures` (a method built on DFlash's drafter names
    its own; its own keys are its to check)."""
    if "speculators_model_type" in config:
        return _speculators(config, where)
    return _zlab(config, where, architecture)


def _zlab(config: dict[str, Any], where: str, architecture: str) -> DraftConfig:
    check_fields(config, ZLAB, where, "z-lab draft")
    dflash = dict(config.get("dflash_config") or {})
    check_fields(dflash, DFLASH_CONFIG, where, "z-lab draft", "dflash_config.")
    arch = config.get("architectures") or []
    if arch != [architecture]:
        raise JobError(f"draft: architectures {arch} is not supported (only {architecture})")
    kind = config.get("model_type")
    if kind not in DRAFT_LAYERS:
        raise JobError(
            f"{where}: model_type is {kind!r}; batchrun runs {' and '.join(DRAFT_LAYERS)} drafts"
        )
    if config.get("sample_from_anchor") or dflash.get("sample_from_anchor"):
        raise JobError("draft: sample_from_anchor: true is not supported")
    causal = config.get("is_causal", dflash.get("causal"))
    return DraftConfig(
        format="z-lab",
        layers=config,
        layers_where=where,
        block_size=config.get("block_size", dflash.get("block_size")),
        mask_token_id=dflash.get("mask_token_id"),
        layer_ids=dflash.get("target_layer_ids"),
        layer_ids_key="target_layer_ids",
        layer_id_base=0,
        num_target_layers=config.get("num_target_layers"),
        draft_vocab_size=config.get("draft_vocab_size"),
        full_causal=bool(causal) if causal is not None else False,
        sliding_causal=bool(causal) if causal is not None else True,
    )


VERIFIER_TENSORS = frozenset(
    {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
)


def _speculators(config: dict[str, Any], where: str) -> DraftConfig:
    check_fields(config, SPECULATORS, where, "speculators draft")
    kind = config.get("speculators_model_type")
    if kind != "dflash":
        raise JobError(
            f"draft: speculators_model_type {kind!r} is not supported (only dflash drafts)"
        )
    if config.get("projector_type", "dflash") != "dflash":
        raise JobError(
            f"draft: projector_type {config['projector_type']!r} is not supported (only dflash)"
        )
    for key in ("sample_from_anchor", "shift_label"):
        if config.get(key):
            raise JobError(f"draft: {key}: true is not supported")
    layers = _filled_qwen3_config(config.get("transformer_layer_config"))
    hidden = config.get("target_hidden_size")
    if hidden is not None and hidden != layers.get("hidden_size"):
        raise JobError(
            f"draft: target_hidden_size {hidden} differs from the draft's hidden_size "
            f"{layers.get('hidden_size')} (features of another width are not supported)"
        )
    if config.get("aux_hidden_state_layer_ids") is None:
        raise JobError("draft: aux_hidden_state_layer_ids is missing")
    return DraftConfig(
        format="speculators",
        layers=layers,
        layers_where=f"{where} transformer_layer_config",
        block_size=config.get("block_size"),
        mask_token_id=config.get("mask_token_id"),
        layer_ids=config["aux_hidden_state_layer_ids"],
        layer_ids_key="aux_hidden_state_layer_ids",
        layer_id_base=1,  # hidden-state index k is the output of layer k - 1
        num_target_layers=None,
        draft_vocab_size=config.get("draft_vocab_size"),
        full_causal=False,
        sliding_causal=not config.get("sliding_window_non_causal", False),
        verifier_tensors=VERIFIER_TENSORS,
    )


def _filled_qwen3_config(layers: Any) -> dict[str, Any]:
    """transformer_layer_config with Qwen3Config's defaults where keys are left out."""
    from transformers import Qwen3Config

    if not isinstance(layers, dict):
        raise JobError("draft: transformer_layer_config is missing")
    if layers.get("model_type", "qwen3") != "qwen3":
        raise JobError(
            f"draft: transformer_layer_config has model_type {layers['model_type']!r}; "
            "batchrun runs qwen3 drafts"
        )
    try:
        return Qwen3Config(**layers).to_dict()
    except Exception as e:  # transformers' validation raises several error types
        message = " ".join(str(e).split())
        raise JobError(f"draft: transformer_layer_config is not Qwen3's: {message}") from None
