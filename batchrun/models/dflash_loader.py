"""Load a z-lab format DFlash draft directory and check that it fits its target."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from batchrun.errors import JobError
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.dflash import DFlashDraft, default_target_layer_ids
from batchrun.models.loader import iter_safetensors, load_weights, qwen3_shape, read_config
from batchrun.models.qwen3 import Qwen3ForCausalLM


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


def load_dflash(
    draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
) -> DFlashDraft:
    config = read_config(draft_dir, "draft")
    dflash = dict(config.get("dflash_config") or {})
    _refuse_variants(config, dflash)
    shape = qwen3_shape(config, "draft")
    t = target.shape
    if shape.hidden_size != t.hidden_size:
        raise JobError(
            f"draft: hidden_size {shape.hidden_size} does not match the target's {t.hidden_size}"
        )
    if shape.vocab_size != t.vocab_size:
        raise JobError(
            f"draft: vocab_size {shape.vocab_size} does not match the target's {t.vocab_size}"
        )
    block_size = config.get("block_size", dflash.get("block_size"))
    if not isinstance(block_size, int) or block_size < 2:
        raise JobError(f"draft: block_size must be an integer >= 2, got {block_size!r}")
    mask_id = dflash.get("mask_token_id")
    if not isinstance(mask_id, int):
        raise JobError("draft: dflash_config.mask_token_id is missing")
    if not 0 <= mask_id < t.vocab_size:
        raise JobError(
            f"draft: mask_token_id {mask_id} is outside the target's embedding "
            f"({t.vocab_size} rows)"
        )
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        n_target = int(config.get("num_target_layers", t.num_layers))
        layer_ids = default_target_layer_ids(shape.num_layers, n_target)
    bad = [i for i in layer_ids if not (isinstance(i, int) and 0 <= i < t.num_layers)]
    if bad or not layer_ids:
        raise JobError(
            f"draft: target_layer_ids {layer_ids} must be layers of the target "
            f"(0..{t.num_layers - 1})"
        )

    dtype = target.lm_head.weight.dtype
    with torch.device("meta"):
        draft = DFlashDraft(shape, layer_ids, block_size, mask_id, max_positions).to(dtype)
    draft.to_empty(device=device)
    load_weights(draft, _refuse_vocab_maps(iter_safetensors(draft_dir)), "draft", skip=set())
    draft.rope = RotaryEmbedding(shape.head_dim, max_positions, shape.rope_theta).to(device)
    return draft.eval()


def _refuse_vocab_maps(
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        if name in ("d2t", "t2d"):
            raise JobError(f"draft: a reduced draft vocabulary ({name!r}) is not supported")
        yield name, tensor
