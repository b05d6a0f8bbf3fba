"""Check that a DFlash2 draft (z-lab's `DFlash2DraftModel`, docs/dflash.md section DFlash2)
fits its target from its config and tensor headers alone, then load it. What it shares with a
DFlash draft (its layers, features, block, mask, window) is checked by DFlash's checks
(models/dflash_loader.py); its own `dflash_config` keys and selector tensors here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchrun.errors import JobError
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.config_check import NEEDED_SIZE
from batchrun.models.config_fields import Field, check_fields
from batchrun.models.dflash2 import CONV_TAPS, DFlash2Draft
from batchrun.models.dflash_loader import DraftSpec, check_draft, tensor_shapes
from batchrun.models.header_weights import header_weights
from batchrun.models.loader import (
    checkpoint_weights,
    config_file,
    load_weights,
    read_config,
    release_staging,
)
from batchrun.models.meta import shapes_only
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape

ARCHITECTURE = "DFlash2DraftModel"
# Its own keys in dflash_config (the published drafters': conv 2 taps over groups of 16
# channels, selector rank 256, top 16, softcapping 20).
DFLASH2_CONFIG = {
    "conv_kernel_size": NEEDED_SIZE,
    "conv_group_size": NEEDED_SIZE,
    "selector_rank": NEEDED_SIZE,
    "selector_top_k": NEEDED_SIZE,
    "final_logit_softcapping": Field("number", 0, above=True, null=True),
    "output_multiplier": Field("number", 0, above=True, null=True),
    "input_embedding_scale": Field("number", null=True),
}
SELECTOR = "candidate_selector."


@dataclass(frozen=True)
class DFlash2Spec:
    """A DFlash2 draft as its config.json and tensor headers describe it, checked to fit."""

    dflash: DraftSpec  # what it shares with a DFlash draft
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    softcapping: float | None
    output_multiplier: float

    def model_args(self) -> dict[str, Any]:
        return {
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
            "softcapping": self.softcapping,
            "output_multiplier": self.output_multiplier,
        }


def check_dflash2(draft_dir: Path, target: Qwen3Shape) -> DFlash2Spec:
    """Every check of a DFlash2 draft against its target that needs no weights. Raises
    JobError."""
    dflash = check_draft(draft_dir, target, ARCHITECTURE)
    where = f"draft: {config_file(draft_dir)}"
    own = dict(read_config(draft_dir, "draft").get("dflash_config") or {})
    check_fields(own, DFLASH2_CONFIG, where, "DFlash2 draft", "dflash_config.")
    taps = own["conv_kernel_size"]
    if taps != CONV_TAPS:
        raise JobError(
            f"draft: conv_kernel_size {taps} is not supported (batchrun implements {CONV_TAPS})"
        )
    group, hidden = own["conv_group_size"], dflash.shape.hidden_size
    if hidden % group:
        raise JobError(f"draft: conv_group_size {group} does not divide hidden_size {hidden}")
    top_k, vocab = own["selector_top_k"], target.vocab_size
    if top_k > vocab:
        raise JobError(f"draft: selector_top_k {top_k} is larger than the vocabulary ({vocab})")
    if dflash.head_rows is not None:
        raise JobError("draft: a DFlash2 draft with its own lm_head is not supported")
    if own.get("input_embedding_scale", 1.0) not in (None, 1, 1.0):
        raise JobError(
            f"draft: input_embedding_scale {own['input_embedding_scale']} is not supported"
        )
    _check_selector(tensor_shapes(draft_dir), own["selector_rank"], hidden, vocab)
    return DFlash2Spec(
        dflash=dflash,
        conv_group_size=group,
        selector_rank=own["selector_rank"],
        selector_top_k=top_k,
        softcapping=own.get("final_logit_softcapping"),
        output_multiplier=float(own.get("output_multiplier") or 1.0),
    )


def _check_selector(tensors: dict[str, list[int]], rank: int, hidden: int, vocab: int) -> None:
    expected = {
        "hidden_projection.weight": [rank, hidden],
        "predecessor_codebook": [vocab, rank],
        "successor_codebook": [vocab, rank],
    }
    for name, shape in expected.items():
        found = tensors.get(SELECTOR + name)
        if found is None:
            raise JobError(f"draft: {SELECTOR}{name} is missing (DFlash2's candidate selector)")
        if found != shape:
            raise JobError(f"draft: {SELECTOR}{name} has shape {found}, expected {shape}")


def _module(spec: DFlash2Spec, max_positions: int, dtype: torch.dtype) -> DFlash2Draft:
    """The draft built on the meta device."""
    d = spec.dflash
    with shapes_only():
        return DFlash2Draft(
            d.shape,
            list(d.target_layer_ids),
            d.block_size,
            d.mask_token_id,
            max_positions,
            d.attention,
            **spec.model_args(),
        ).to(dtype)


def check_dflash2_weights(draft_dir: Path, spec: DFlash2Spec, dtype: torch.dtype) -> int:
    """load_weights's checks against the headers alone; the bytes its weights take."""
    module = _module(spec, 1, dtype)
    tensors = header_weights(draft_dir, spec.dflash.shape, "draft")
    load_weights(module, tensors, "draft", skip=set(spec.dflash.not_loaded))
    return sum(p.numel() * p.element_size() for p in module.parameters())


def load_dflash2(
    draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
) -> DFlash2Draft:
    spec = check_dflash2(draft_dir, target.shape)
    shape = spec.dflash.shape
    draft = _module(spec, max_positions, target.lm_head.weight.dtype)
    draft.to_empty(device=device)
    tensors = checkpoint_weights(draft_dir, shape, device, "draft")
    load_weights(draft, tensors, "draft", skip=set(spec.dflash.not_loaded))
    release_staging(device)
    draft.rope = RotaryEmbedding(
        shape.head_dim, max_positions, shape.rope_theta, shape.rope_scaling
    ).to(device)
    draft.pack_context_kv()
    return draft.eval()
