"""The DFlash speculator: everything a DFlash draft needs, behind spec_decode/base.py's
interface. It owns the draft model, its K/V (full-attention layers in caches indexed like the
target's pages, sliding ones in per-slot rings), the features carried from the last verify, the
per-slot rows of that verify still to enter the draft's context, the draft's CUDA graphs and
the verify-width policy with its counts. Of the target it sees only the view its runner handed
it (TargetView).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta, allocate_kv, row_starts
from batchrun.device import put
from batchrun.models.dflash import DFlashDraft
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.acceptance import accepted_lengths
from batchrun.spec_decode.base import (
    Admitted,
    ContextRows,
    Speculator,
    StepShape,
    TargetView,
)
from batchrun.spec_decode.dflash.draft_clock import DraftClock
from batchrun.spec_decode.dflash.graphs import DraftGraphs
from batchrun.spec_decode.dflash.inputs import (
    DraftContext,
    DraftInputs,
    context_feature_rows,
    draft_inputs,
)
from batchrun.spec_decode.dflash.rings import DraftRing
from batchrun.spec_decode.method import DraftBackends
from batchrun.spec_decode.row_widths import RowAcceptance
from batchrun.spec_decode.width_policy import WidthPolicy, step_width


class DFlashSpeculator(Speculator):
    def __init__(
        self,
        target: TargetView,
        draft: DFlashDraft,
        backends: DraftBackends,
        *,
        widths: tuple[int, ...],
        max_batch_size: int,
        tp: TensorParallel | None = None,
    ) -> None:
        """widths: the verify widths it may choose (spec_decode/verify_widths.py)."""
        super().__init__()
        self.target, self.draft, self.tp = target, draft, tp
        self.backend, self.window_backend = backends.backend, backends.window_backend
        self.drafting = True
        self.block_size = block = draft.block_size
        self.widths = widths
        self.capture_layers = draft.target_layer_ids
        window = draft.attention.window
        # A sliding draft's first block reads back the W - 1 positions before its anchor.
        self.recompute_tail = max(window - 1, 1) if window else 1
        device, page_size = target.device, target.page_size
        # A full-attention layer's cache is indexed by the target's page tables: position i of
        # a request lives at the same cache index in both. A sliding layer's lives in its ring.
        self.ring = None
        if window is not None:
            self.ring = DraftRing(
                max_batch_size, target.max_pages, window, block, page_size, device
            )
        shape, dtype = draft.shape, target.model.lm_head.weight.dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for sliding in draft.attention.sliding:
            pages = self.ring.num_pages if sliding and self.ring else target.num_pages
            self.kv_caches += allocate_kv(
                1, pages, page_size, shape.num_kv_heads, shape.head_dim, dtype, device
            )
        self.context = DraftContext.zeros(target.state.num_slots + 1, device)
        self.drafts = torch.zeros(max_batch_size, block - 1, dtype=torch.int64, device=device)
        self.features: torch.Tensor | None = None  # the last target forward's captured rows
        self.graphs: DraftGraphs | None = None
        # The last verify's committed rows are not yet in the draft's context: the next step
        # stores them, by drafting or, at width 1, on their own.
        self._verified_unstored = False
        self.policy: WidthPolicy | None = None
        self.rows: RowAcceptance | None = None  # each row's acceptance, under `auto`
        self.width_steps: Counter[int] = Counter()  # verify width -> steps decoding at it
        self.draft_seconds: dict[int, list[float]] = {}  # width -> [steps, the draft's seconds]
        self._last_width = 0  # the width of the step read back before
        self.clock = DraftClock(device)

    # -- the width ----------------------------------------------------------------------------

    def start_job(self, max_batch_size: int, max_batched_tokens: int) -> None:
        self.max_batch_size, self.max_batched_tokens = max_batch_size, max_batched_tokens
        many = len(self.widths) > 1
        self.policy = WidthPolicy(self.block_size, self.widths) if many else None
        self.rows = RowAcceptance(max_batch_size + 1, self.block_size) if many else None
        self.width_steps, self.draft_seconds = Counter(), {}
        self._last_width = 0
        self.clock.clear()

    @property
    def writes_context(self) -> bool:
        """False while the policy holds the drafter dormant: width-1 decode steps then capture
        no features and write none of its context (prefill chunks still do). Pinned widths,
        fixed widths and tensor parallelism (each rank's draft must see the same context)
        always write."""
        policy = self.policy
        if policy is None or self.tp is not None or self.hooks.pinned_width is not None:
            return True
        return policy.writes_context

    def next_widths(self, slots: Sequence[int], prefill_pending: bool) -> dict[int, int]:
        """A pinned or fixed width for every row; else the policy's step width, and each row's
        own under it (row_widths.py). Under tensor parallelism every row verifies at the step
        width, rank 0's: the rows' widths follow each rank's step times."""
        pinned = self.hooks.pinned_width
        if pinned is not None or self.policy is None:
            return dict.fromkeys(slots, pinned or self.widths[-1])
        running = len(slots)
        bucket = self.target.graphs.bucket(running, self.max_batch_size)
        width = step_width(
            self.policy,
            bucket=bucket,
            running=running,
            prefill_pending=prefill_pending,
            max_batched_tokens=self.max_batched_tokens,
        )
        if self.tp is not None:  # chosen from this rank's step times: rank 0's wins
            return dict.fromkeys(slots, self.tp.first_int(width))
        if self.rows is not None:  # after the choice: it may have forgotten the acceptance
            self.rows.follow(slots, self.policy.relearned)
        # A row alone is the batch: the step's width is already its own.
        if width == 1 or self.rows is None or self.policy.probing or running == 1:
            return dict.fromkeys(slots, width)
        probe = min(w for w in self.widths if w > 1)
        widths = self.rows.widths(slots, width, self.policy.accept(), probe)
        if widths:
            self.policy.row_share = sum(w == width for w in widths.values()) / len(widths)
        return widths

    def learn(self, step: StepShape, accepted: list[int], seconds: float) -> None:
        """Feeds the policy: the rounds' acceptance, the draft's own time, every step's time,
        its rows' (a job's first step too: often a compute-bound prefill), and the step's cost
        when every request decoded (a step with prefill chunks says little about a width's
        cost) and the width was the last step's too (a switch costs the pipeline more than the
        width does; the draft's time, on the device's clock, is its own either way)."""
        width, first = step.max_width, self._last_width == 0
        switched = not first and width != self._last_width
        self._last_width = width
        if step.num_decoding:
            self.width_steps[width] += 1
        draft_ms = self.clock.take_ms(step)
        if draft_ms is not None:
            timed = self.draft_seconds.setdefault(width, [0, 0.0])
            timed[0], timed[1] = timed[0] + 1, timed[1] + draft_ms / 1e3
        policy = self.policy
        if policy is None:
            return
        for slot, w, a in zip(step.decode_slots, step.widths, accepted, strict=True):
            if w > 1:
                policy.record_round(w, a)
                if self.rows is not None:
                    self.rows.record(slot, w, a)
        graphs = self.target.graphs
        bucket = graphs.bucket(step.num_live, self.max_batch_size)
        if draft_ms is not None and step.uniform:  # the draft's time is its drafting rows'
            drafting = sum(w > 1 for w in step.widths)
            policy.record_draft(graphs.bucket(drafting, self.max_batch_size), draft_ms)
        if seconds <= 0:
            return
        policy.record_elapsed(seconds * 1e3)
        if not switched:
            policy.record_rows(step.num_rows, seconds * 1e3)
        if not switched and not first and step.uniform:
            policy.record_cost(width, bucket, seconds * 1e3)

    def aborted(self) -> None:
        self._last_width = 0
        self.clock.clear()

    # -- a step -------------------------------------------------------------------------------

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None:
        self.context.admit(slots)
        self.hooks.admit(requests, slots)
        if self.policy is not None:
            self.policy.record_admitted(len(requests))

    @torch.inference_mode()
    def propose(self, step: StepShape, slots: torch.Tensor) -> torch.Tensor | None:
        """Drafts one block per decoding request verifying above width 1, after storing the
        context K/V of the rows every decoding request's last verify committed; a step at
        width 1 only stores those."""
        d = step.num_decoding
        if not d:
            return None
        if step.max_width == 1:
            if self._verified_unstored and self.writes_context:
                self._store_verified(slots[:d])
            self._verified_unstored = False  # dormant: dropped, a hole in the context
            return None
        drafts = self.clock.time(step, lambda: self._draft_step(step, slots))
        # In place: a graph's target reads them there.
        self.hooks.rewrite(drafts, slots[:d], self.target.state.out_len)
        return drafts

    def graph_drafts(self, size: int) -> torch.Tensor:
        return self.drafts[:size]

    def store_context(self, features: torch.Tensor, rows: ContextRows) -> None:
        window_kv_index = None
        if self.ring is not None:  # a chunk's rows, up to the ring's last positions
            end = rows.meta.kv_lens.long()[rows.row_req]
            committed = rows.context_kv_index >= 0
            window_kv_index = self.ring.kv_index(rows.row_slot, rows.meta.positions, end, committed)
        self.draft.write_context(
            features,
            rows.meta.positions,
            rows.context_kv_index,
            window_kv_index,
            self.backend,
            self.kv_caches,
        )

    def observe(self, features: torch.Tensor | None) -> None:
        self.features = features

    def accept(
        self,
        drafts: torch.Tensor | None,
        tokens: torch.Tensor,
        step: StepShape,
        widths: torch.Tensor,
    ) -> torch.Tensor:
        if drafts is None:
            return tokens.new_zeros(step.num_decoding)
        return accepted_lengths(drafts, tokens, row_starts(widths), widths)

    def commit(
        self, slots: torch.Tensor, accepted: torch.Tensor, step: StepShape, widths: torch.Tensor
    ) -> None:
        drafted = step.max_width > 1
        self._verified_unstored = self.context.commit(slots, accepted, widths, drafted)

    def _draft_step(self, step: StepShape, slots: torch.Tensor) -> torch.Tensor:
        """The step's drafts [D, B-1] in the buffer the target's graphs read: a block for each
        request verifying above width 1 (a width-1 row's drafts are read by none: zeros), after
        the context of every decoding request's last verify is stored (a width-1 row's without
        drafting, as a step that drafts nothing stores it)."""
        d = step.num_decoding
        decoding = slots[:d]
        drafting = [r for r, w in enumerate(step.widths) if w > 1]
        index = None
        if len(drafting) < d:
            device = slots.device
            rest = [r for r, w in enumerate(step.widths) if w == 1]
            self._store_verified(decoding[put(rest, torch.int64, device)])
            index = put(drafting, torch.int64, device)
            decoding = decoding[index]
        context = self._verified_context(decoding)
        self._verified_unstored = False
        graphs = self.graphs
        size = graphs.size(len(drafting)) if graphs is not None else None
        if size is not None:
            assert graphs is not None
            drafted = graphs.replay(size, context, decoding)
        else:  # eager: the blocks end by the step's longest context, with a block
            max_kv = step.max_kv - min(step.widths) + self.block_size
            drafted = self._draft(decoding, context, max_kv)
        drafts = self.drafts[:d]
        if index is None:
            drafts.copy_(drafted)
        else:
            drafts.zero_()
            drafts.index_copy_(0, index, drafted)
            self._place(index, len(drafting))
        return drafts

    def _place(self, index: torch.Tensor, num_drafted: int) -> None:
        """After a step drafted only its decoding requests at `index` (in that order, first in
        the per-request buffers): what a method keeps per drafted request moves to its
        request's row (DFlash's drafts are placed by _draft_step)."""

    def _store_verified(self, slots: torch.Tensor) -> None:
        """The draft context of the last verify's committed rows, without drafting."""
        context = self._verified_context(slots)
        if context is not None:
            self._write_context(context, self._inputs(slots))
        self._verified_unstored = False

    def _verified_context(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The features of the rows each request's last verify committed, B rows each."""
        if self.features is None:
            return None
        rows = context_feature_rows(self.context, slots, self.block_size, self.features.shape[0])
        return self.features.index_select(0, rows)

    def _inputs(self, slots: torch.Tensor, max_kv: int | None = None) -> DraftInputs:
        return draft_inputs(
            self.target.state,
            self.context,
            slots,
            self.block_size,
            self.draft.mask_token_id,
            self.target.page_size,
            max_kv or self.target.max_kv,
            self.draft.attention,
            self.ring,
        )

    def _write_context(self, context: torch.Tensor, inputs: DraftInputs) -> None:
        self.draft.write_context(
            context,
            inputs.ctx_positions,
            inputs.ctx_kv_index,
            inputs.ctx_window_kv_index,
            self.backend,
            self.kv_caches,
        )

    def _draft(
        self, slots: torch.Tensor, context: torch.Tensor | None, max_kv: int | None = None
    ) -> torch.Tensor:
        inputs = self._inputs(slots, max_kv)
        if context is not None:
            self._write_context(context, inputs)
        if self.draft.attention.num_full:
            self.backend.plan(inputs.meta)
        if inputs.window_meta is not None:
            assert self.window_backend is not None, "sliding draft layers need window_backend"
            self.window_backend.plan(inputs.window_meta)
        return self._block(inputs, slots)

    def _block(self, inputs: DraftInputs, slots: torch.Tensor) -> torch.Tensor:
        """The drafted tokens [R, B-1] of the planned blocks of requests in `slots` (a method
        built on this speculator chooses them its own way here)."""
        return self.draft.draft_block(
            self.target.model,
            inputs.block_ids,
            inputs.meta.positions,
            self.backend,
            self.window_backend,
            self.kv_caches,
        )

    # -- CUDA graphs --------------------------------------------------------------------------

    def capture_graphs(self, max_batch_size: int, pool: Any) -> None:
        """The draft's block at the sizes of the narrowest drafting width's target graphs."""
        drafting = [w for w in self.widths if w > 1]
        if not drafting:
            return
        target, block = self.target, self.block_size
        hidden = target.model.shape.hidden_size
        self.graphs = DraftGraphs(
            target.graphs,
            draft=self._draft,
            backends=self._graph_backends(),
            metas=self._metas,
            context=torch.zeros(
                max_batch_size * block,
                hidden * len(self.capture_layers),
                dtype=target.model.lm_head.weight.dtype,
                device=target.device,
            ),
            block_size=block,
            max_batch_size=max_batch_size,
            scratch_slot=target.state.num_slots,
        )
        self.graphs.capture(target.graphs.sizes(max_batch_size, min(drafting)), pool)

    def _graph_backends(self) -> list[AttentionBackend]:
        """The backends that attend in the draft's graphs, in the order of `_metas`: the full
        layers', then the sliding ones'."""
        full = [self.backend] if self.draft.attention.num_full else []
        return full + ([self.window_backend] if self.window_backend is not None else [])

    def _metas(self, slots: torch.Tensor) -> list[AttentionMeta]:
        inputs = self._inputs(slots)
        metas = [inputs.meta] if self.draft.attention.num_full else []
        return metas + ([inputs.window_meta] if inputs.window_meta is not None else [])

    def info(self) -> dict[str, Any]:
        drafts = {str(w): [int(n), round(t, 4)] for w, (n, t) in sorted(self.draft_seconds.items())}
        return {
            "verify_width_steps": dict(sorted(self.width_steps.items())) or None,
            "draft_seconds": drafts or None,  # the draft's own time, by width: [steps, seconds]
        }
