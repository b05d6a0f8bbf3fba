"""Tiny DFlash2 drafters in z-lab's published layout (the config's `DFlash2DraftModel` and
`dflash_config` keys, the per-layer convolutions and the candidate selector's tensors, as in
z-lab/dflash's tests/fixtures/dflash2-*.json), random or from given tensors, for the tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from batchrun.tools.tiny import DECISIVE_INIT
from batchrun.tools.tiny_draft import make_tiny_draft

ARCHITECTURE = "DFlash2DraftModel"
SELECTOR = "candidate_selector."


def dflash2_keys(
    *,
    conv_group_size: int = 16,
    selector_rank: int = 8,
    selector_top_k: int = 4,
    softcapping: float | None = 20.0,
    output_multiplier: float | None = 0.5,
) -> dict[str, Any]:
    """DFlash2's own dflash_config keys (None leaves a key out)."""
    keys = {
        "conv_kernel_size": 2,
        "conv_group_size": conv_group_size,
        "selector_rank": selector_rank,
        "selector_top_k": selector_top_k,
        "final_logit_softcapping": softcapping,
        "output_multiplier": output_multiplier,
    }
    return {k: v for k, v in keys.items() if v is not None}


def dflash2_tensors(
    num_layers: int, hidden: int, vocab: int, keys: dict[str, Any], seed: int
) -> dict[str, torch.Tensor]:
    """Random convolution and selector tensors under z-lab's names, large enough that the
    convolutions and the selector change the drafts."""
    gen = torch.Generator().manual_seed(seed + 2)
    taps, rank = keys["conv_kernel_size"], keys["selector_rank"]
    groups = hidden // keys["conv_group_size"]
    tensors = {}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            tensors[p + "base_kernel"] = torch.randn(2, taps, hidden, generator=gen) * 0.5 + 0.5
            tensors[p + "kernel_projection.weight"] = (
                torch.randn(2 * taps * groups, hidden, generator=gen) * DECISIVE_INIT / 2
            )
    tensors[SELECTOR + "hidden_projection.weight"] = (
        torch.randn(rank, hidden, generator=gen) * DECISIVE_INIT
    )
    for book in ("predecessor_codebook", "successor_codebook"):
        tensors[SELECTOR + book] = torch.randn(vocab, rank, generator=gen)
    return tensors


def make_tiny_dflash2(
    out_dir: Path | str,
    target_dir: Path | str,
    *,
    num_layers: int = 2,
    block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    keys: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    drop: tuple[str, ...] = (),
    sliding_window: int | None = None,
) -> Path:
    """A DFlash2 drafter for the target in target_dir: DFlash's tiny draft (tools/tiny_draft.py)
    with DFlash2's keys (dflash2_keys's, overridden by `keys`) and tensors (random, or
    state_dict as given; a key None: left out); `drop`: tensors left out (a broken checkpoint)."""
    own = {k: v for k, v in (dflash2_keys() | (keys or {})).items() if v is not None}
    draft = make_tiny_draft(
        out_dir,
        target_dir,
        num_layers=num_layers,
        block_size=block_size,
        target_layer_ids=target_layer_ids,
        seed=seed,
        sliding_window=sliding_window,
    )
    config = json.loads((draft / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    config["is_causal"] = False  # the published drafters' (sliding layers included)
    config["dflash_config"] |= own
    if state_dict is None:
        state_dict = load_file(str(draft / "model.safetensors"))
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        state_dict |= dflash2_tensors(num_layers, hidden, vocab, own, seed)
    state_dict = {k: v for k, v in state_dict.items() if k not in drop}
    return make_tiny_draft(
        out_dir,
        target_dir,
        num_layers=num_layers,
        block_size=block_size,
        target_layer_ids=target_layer_ids,
        seed=seed,
        sliding_window=sliding_window,
        state_dict=state_dict,
        extra_config={k: config[k] for k in ("architectures", "is_causal", "dflash_config")},
    )
