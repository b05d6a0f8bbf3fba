"""Check that a z-lab format DFlash draft fits its target (config alone), then load it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from batchrun.errors import JobError
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.dflash import DFlashDraft, default_target_layer_ids
from batchrun.models.loader import iter_safetensors, load_weights, qwen3_shape, read_config
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape


def _refuse_variants(config: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Refuse, by name, every variant dflash.md does not cover."""
    arch = config.get("architectures") or []
    if arch != ["DFlashDraftModel"]:
        raise JobError(f"draft: architectures {arch} is not supported (only DFlashDraftModel)")
    if config.get("sample_from_anchor") or dflash.get("sample_from_anchor"):
        raise JobError("draft: sample_from_anchor: true is not supported")
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise JobError("draft: sliding-window attention layers are not supported")
    if "draft_vocab_size" in config or "d2t" in dflash:
        raise JobError(
            "draft: a reduced draft vocabulary (d2t / draft_vocab_size) is not supported"
        )


@dataclass(frozen=True)
class DraftSpec:
    """A draft as its config.json describes it, checked to fit its target."""

    shape: Qwen3Shape
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int


def check_draft(draft_dir: Path, target: Qwen3Shape) -> DraftSpec:
    """Every check of a draft against its target that needs no weights: its config.json and
    the tensor names in its safetensors headers. Raises JobError."""
    config = read_config(draft_dir, "draft")
    dflash = dict(config.get("dflash_config") or {})
    _refuse_variants(config, dflash)
    _refuse_vocab_maps(_tensor_names(draft_dir))
    shape = qwen3_shape(config, "draft")
    if shape.hidden_size != target.hidden_size:
        raise JobError(
            f"draft: hidden_size {shape.hidden_size} does not match the target's "
            f"{target.hidden_size}"
        )
    if shape.vocab_size != target.vocab_size:
        raise JobError(
            f"draft: vocab_size {shape.vocab_size} does not match the target's {target.vocab_size}"
        )
    block_size = config.get("block_size", dflash.get("block_size"))
    if not isinstance(block_size, int) or block_size < 2:
        raise JobError(f"draft: block_size must be an integer >= 2, got {block_size!r}")
    mask_id = dflash.get("mask_token_id")
    if not isinstance(mask_id, int):
        raise JobError("draft: dflash_config.mask_token_id is missing")
    if not 0 <= mask_id < target.vocab_size:
        raise JobError(
            f"draft: mask_token_id {mask_id} is outside the target's embedding "
            f"({target.vocab_size} rows)"
        )
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        n_target = int(config.get("num_target_layers", target.num_layers))
        layer_ids = default_target_layer_ids(shape.num_layers, n_target)
    bad = [i for i in layer_ids if not (isinstance(i, int) and 0 <= i < target.num_layers)]
    if bad or not layer_ids:
        raise JobError(
            f"draft: target_layer_ids {layer_ids} must be layers of the target "
            f"(0..{target.num_layers - 1})"
        )
    return DraftSpec(shape, tuple(layer_ids), block_size, mask_id)


def load_dflash(
    draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
) -> DFlashDraft:
    spec = check_draft(draft_dir, target.shape)
    shape = spec.shape
    dtype = target.lm_head.weight.dtype
    with torch.device("meta"):
        draft = DFlashDraft(
            shape, list(spec.target_layer_ids), spec.block_size, spec.mask_token_id, max_positions
        ).to(dtype)
    draft.to_empty(device=device)
    load_weights(draft, iter_safetensors(draft_dir), "draft", skip=set())
    draft.rope = RotaryEmbedding(shape.head_dim, max_positions, shape.rope_theta).to(device)
    draft.pack_context_kv()
    return draft.eval()


def _tensor_names(model_dir: Path) -> list[str]:
    """The tensor names of a checkpoint, read from the safetensors headers alone."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise JobError(f"no .safetensors files in {model_dir}")
    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names += f.keys()
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise JobError(f"cannot read {file}: {e}".splitlines()[0]) from None
    return names


def _refuse_vocab_maps(names: list[str]) -> None:
    for name in names:
        if name in ("d2t", "t2d"):
            raise JobError(f"draft: a reduced draft vocabulary ({name!r}) is not supported")
