"""DFlash2 as a speculation method (spec_decode/method.py): its drafts' checks and loader
(models/dflash2_loader.py), their layout (DFlash's: the same layers, rings and widths) and the
speculator."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from batchrun.models.dflash2 import DFlash2Draft
from batchrun.models.dflash2_loader import (
    ARCHITECTURE,
    DFlash2Spec,
    check_dflash2,
    check_dflash2_weights,
    load_dflash2,
)
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.base import Speculator, TargetView
from batchrun.spec_decode.dflash.method import DFLASH
from batchrun.spec_decode.dflash2.speculator import DFlash2Speculator
from batchrun.spec_decode.method import DraftBackends, DraftLayout


class DFlash2:
    name = "dflash2"
    architectures = frozenset({ARCHITECTURE})

    def check(self, draft_dir: Path, target: Qwen3Shape) -> DFlash2Spec:
        return check_dflash2(draft_dir, target)

    def check_weights(
        self, draft_dir: Path, spec: DFlash2Spec, target: Qwen3Shape, dtype: torch.dtype
    ) -> int:
        return check_dflash2_weights(draft_dir, spec, dtype)

    def describe(self, spec: DFlash2Spec) -> str:
        return (
            f"{DFLASH.describe(spec.dflash)}, convolutions over groups of "
            f"{spec.conv_group_size} channels, selector rank {spec.selector_rank} over the top "
            f"{spec.selector_top_k}"
        )

    def layout(self, draft: DFlash2Spec | DFlash2Draft) -> DraftLayout:
        return DFLASH.layout(draft.dflash if isinstance(draft, DFlash2Spec) else draft)

    def load(
        self, draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
    ) -> DFlash2Draft:
        return load_dflash2(draft_dir, target, device, max_positions)

    def owns(self, draft: nn.Module) -> bool:
        return isinstance(draft, DFlash2Draft)

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
        if not isinstance(draft, DFlash2Draft):
            raise TypeError(
                f"a DFlash2 speculator needs a DFlash2Draft, got {type(draft).__name__}"
            )
        return DFlash2Speculator(
            target, draft, backends, widths=widths, max_batch_size=max_batch_size, tp=tp
        )


DFLASH2 = DFlash2()
