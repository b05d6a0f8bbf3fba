"""The DFlash2 speculator: DFlash's (spec_decode/dflash/speculator.py: the draft's context, K/V,
rings, graphs and width policy, all unchanged) with the block's tokens chosen by the candidate
selector's walk (walk.py) instead of an argmax per row. The walk runs on the device inside the
drafting CUDA graph, over buffers of fixed shape.

It walks greedily at every temperature: its proposals are then a point mass, which the
engine's verify (a draft is accepted where it equals the target's sampled token) keeps
lossless; a sampled walk with its q handed to the verify is not wired yet (docs/dflash.md)."""

from __future__ import annotations

import torch

from batchrun.models.dflash2 import DFlash2Draft
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.base import TargetView
from batchrun.spec_decode.dflash.inputs import DraftInputs
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from batchrun.spec_decode.dflash2.walk import walk
from batchrun.spec_decode.method import DraftBackends


class DFlash2Speculator(DFlashSpeculator):
    def __init__(
        self,
        target: TargetView,
        draft: DFlash2Draft,
        backends: DraftBackends,
        *,
        widths: tuple[int, ...],
        max_batch_size: int,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(
            target, draft, backends, widths=widths, max_batch_size=max_batch_size, tp=tp
        )
        self.selector_draft = draft
        # The walk's per-request temperature and noise (a greedy walk: zeros), at every batch
        # size the graphs replay; +1: a graph's padding slot.
        rows = max_batch_size + 1
        device = target.device
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.uniforms = torch.zeros(rows, self.block_size - 1, dtype=torch.float32, device=device)

    def _block(self, inputs: DraftInputs) -> torch.Tensor:
        draft = self.selector_draft
        block = draft.block_candidates(
            self.target.model,
            inputs.block_ids,
            inputs.meta.positions,
            self.backend,
            self.window_backend,
            self.kv_caches,
        )
        n = block.unary.shape[0]
        anchors = inputs.block_ids.view(n, self.block_size)[:, 0]
        selector = draft.candidate_selector
        return walk(
            block.unary,
            block.candidates,
            block.hidden_proj,
            anchors,
            selector.predecessor_codebook,
            selector.successor_codebook,
            self.temperature[:n],
            self.uniforms[:n],
        ).tokens
