"""DFlash as a speculation method (spec_decode/method.py): its drafts' checks and loader
(models/dflash_loader.py, z-lab and speculators formats), their layout and the speculator."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from batchrun.models.dflash import DFlashDraft
from batchrun.models.dflash_loader import DraftSpec, check_draft, check_draft_weights, load_dflash
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.base import Speculator, TargetView
from batchrun.spec_decode.dflash.rings import ring_positions
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from batchrun.spec_decode.method import DraftBackends, DraftLayout
from batchrun.spec_decode.width_policy import candidate_widths


class DFlash:
    name = "dflash"
    architectures = frozenset({"DFlashDraftModel"})

    def check(self, draft_dir: Path, target: Qwen3Shape) -> DraftSpec:
        return check_draft(draft_dir, target)

    def check_weights(
        self, draft_dir: Path, spec: DraftSpec, target: Qwen3Shape, dtype: torch.dtype
    ) -> int:
        return check_draft_weights(draft_dir, spec, target.vocab_size, dtype)

    def describe(self, spec: DraftSpec) -> str:
        attention = spec.attention
        layers = f"{spec.shape.num_layers} layers"
        if attention.num_sliding:
            layers += f" ({attention.num_sliding} sliding over {attention.window} positions)"
        vocab = f", draft vocabulary {spec.head_rows}" if spec.vocab_map else ""
        return (
            f"{spec.format} format, {layers}, block size {spec.block_size}, "
            f"target layers {list(spec.target_layer_ids)}, mask id {spec.mask_token_id}{vocab}"
        )

    def layout(self, draft: DraftSpec | DFlashDraft) -> DraftLayout:
        """Its full-attention layers' K/V shares the target's page indices; each sliding
        layer's lives in a ring per slot (rings.py)."""
        attention, block = draft.attention, draft.block_size
        window = attention.window
        return DraftLayout(
            shape=draft.shape,
            block_size=block,
            candidate_widths=candidate_widths(block),
            feature_layers=len(draft.target_layer_ids),
            paged_layers=attention.num_full,
            ring_layers=attention.num_sliding if window is not None else 0,
            ring_positions=ring_positions(window, block) if window is not None else 0,
            window=window,
        )

    def load(
        self, draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
    ) -> DFlashDraft:
        return load_dflash(draft_dir, target, device, max_positions)

    def owns(self, draft: nn.Module) -> bool:
        return type(draft) is DFlashDraft  # not a method's drafter built on it

    def make(
        self,
        target: TargetView,
        draft: nn.Module,
        backends: DraftBackends,
        *,
        widths: tuple[int, ...],
        max_batch_size: int,
        tp: TensorParallel | None,
    ) -> Speculator:
        if not isinstance(draft, DFlashDraft):
            raise TypeError(f"a DFlash speculator needs a DFlashDraft, got {type(draft).__name__}")
        return DFlashSpeculator(
            target, draft, backends, widths=widths, max_batch_size=max_batch_size, tp=tp
        )


DFLASH = DFlash()
