"""The DFlash2 speculator: DFlash's (spec_decode/dflash/speculator.py: the draft's context, K/V,
rings, graphs, width policy and drafting of only the rows verifying above width 1) with the
block's tokens chosen by the candidate selector's walk (walk.py) instead of an argmax per row.
The walk runs on the device inside the drafting CUDA graph, over buffers of fixed shape.

A greedy request walks greedily; a sampled one (temperature > 0) draws each draft from the
walk's softmax with its own Philox uniforms (sampling/draft_verify.py's proposal stream, keyed
by its seed at the step each draft's verify row samples), and the verify samples its tokens
against that q (`proposal`), so the output stays the target's."""

from __future__ import annotations

import torch

from batchrun.models.dflash2 import DFlash2Draft
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.base import StepShape, TargetView
from batchrun.spec_decode.dflash.inputs import DraftInputs
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from batchrun.spec_decode.dflash2.walk import WalkInputs, walk
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
        # The last walk's q and candidate ids per request, where the target's graphs and the
        # verify read them (+1: a graph's padding slot).
        shape = (max_batch_size + 1, self.block_size - 1, draft.selector_top_k)
        self.q = torch.zeros(shape, dtype=torch.float32, device=target.device)
        self.candidates = torch.zeros(shape, dtype=torch.int64, device=target.device)

    def _block(self, inputs: DraftInputs, slots: torch.Tensor) -> torch.Tensor:
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
        state = self.target.state
        tables = state.sampling.tables
        selector = draft.candidate_selector
        edges = WalkInputs(
            block.unary,
            block.candidates,
            block.hidden_proj,
            anchors,
            selector.predecessor_codebook,
            selector.successor_codebook,
            tables["temperature"][slots],
        )
        # Draft j is verified at the row that samples token out_len + j.
        walked = walk(edges, tables["seed"][slots], state.out_len[slots])
        self.q[:n].copy_(walked.q)
        self.candidates[:n].copy_(block.candidates)
        return walked.tokens

    def _place(self, index: torch.Tensor, num_drafted: int) -> None:
        """The walk's q and candidates of the drafted requests to their requests' rows (a
        width-1 row's are read by none)."""
        for kept in (self.q, self.candidates):
            kept.index_copy_(0, index, kept[:num_drafted].clone())

    def proposal(self, step: StepShape) -> tuple[torch.Tensor, torch.Tensor]:
        d = step.num_decoding
        return self.q[:d], self.candidates[:d]
