"""Speculative decoding's one owner. Each step the engine asks its speculator for the verify
width, then for drafts (`propose`), runs the target over them, hands it the target's features
(`observe`) and asks how many drafts the target's tokens accept (`accept`); inside the target
forward, graphs included, the runner passes it the features of rows already committed
(`store_context`).

`Speculator` itself is plain decoding: width 1, no drafts, nothing to store. `DFlashSpeculator`
owns everything a DFlash draft needs: the draft model, its K/V (full-attention layers in the
target's pages, sliding ones in per-slot rings), the features carried from the last verify, the
per-slot rows of that verify still to enter the draft's context, the draft's CUDA graphs, the
verify-width policy and its timings. A second kind of drafter would be a third class.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta, allocate_kv
from batchrun.engine.config import EngineConfig, verify_widths
from batchrun.engine.cuda_graphs import GraphSet, graph_sizes, ladder_bucket
from batchrun.engine.page_pool import pages_for
from batchrun.engine.request import Request
from batchrun.engine.step_inputs import StepArgs, StepPlan, TargetInputs
from batchrun.models.dflash import DFlashDraft
from batchrun.parallel.group import TensorParallel
from batchrun.speculative.acceptance import accepted_lengths
from batchrun.speculative.draft_oracle import DraftOracle
from batchrun.speculative.drafter import (
    DraftContext,
    DraftInputs,
    context_feature_rows,
    draft_inputs,
)
from batchrun.speculative.sliding_window import DraftRing
from batchrun.speculative.verify_width import WidthPolicy, step_width

if TYPE_CHECKING:  # both import this module
    from batchrun.engine.model_runner import ModelRunner
    from batchrun.engine.startup import BackendChoice


class Speculator:
    """Plain decoding: every step verifies one row per request (its anchor) and drafts nothing."""

    drafting = False  # it proposes drafts
    block_size = 1  # the rows a decoding request may verify in a step
    widths: tuple[int, ...] = (1,)  # the verify widths it may choose (graphs exist for each)
    capture_layers: tuple[int, ...] = ()  # the target layers whose hidden states it reads
    # Prompt tokens a request computes even where cached pages hold them (at least its last).
    recompute_tail = 1
    # Benchmark hooks: `batchrun bench` times one width at a time; `bench --jobs` rewrites the
    # drafts with an acceptance oracle (bench/oracle.py). `batchrun run` sets neither.
    pinned_width: int | None = None
    oracle: DraftOracle | None = None

    def start_job(self, max_batch_size: int, max_batched_tokens: int) -> None:
        """A new job: what it learnt about widths is forgotten."""

    def next_width(self, running: int, prefill_pending: bool) -> int:
        """The verify width of the next step over `running` requests."""
        return 1

    def admit(self, requests: list[Request], slots: torch.Tensor) -> None:
        """Requests that just took their slots (`slots`: theirs, on the device)."""

    def propose(self, args: StepArgs, plan: StepPlan) -> torch.Tensor | None:
        """The step's drafts [D, W-1] for its D decoding requests (None: it verifies none)."""
        return None

    def graph_drafts(self, size: int) -> torch.Tensor | None:
        """The buffer a target graph of `size` requests reads its drafts from."""
        return None

    def store_context(self, features: torch.Tensor, inputs: TargetInputs) -> None:
        """Inside the target forward: features of the rows it already commits (prefill chunks;
        at width 1 every row), for the draft's context."""

    def observe(self, features: torch.Tensor | None) -> None:
        """The target forward's features (its rows at capture_layers), the next draft's context."""

    def accept(
        self, drafts: torch.Tensor | None, tokens: torch.Tensor, plan: StepPlan
    ) -> torch.Tensor:
        """On the device: the drafts each decoding request accepts, given the target's tokens."""
        return tokens.new_zeros(plan.num_decoding)

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, plan: StepPlan) -> None:
        """After the step's commit into the device state: `slots` [D] decoding requests'."""

    def learn(self, plan: StepPlan, accepted: list[int], seconds: float) -> None:
        """A step read back: its acceptance and, on a GPU, its period."""

    def aborted(self) -> None:
        """The engine dropped its requests: the next step follows none."""

    def capture_graphs(self, max_batch_size: int, max_batched_tokens: int, pool: Any) -> None:
        """Capture its own CUDA graphs (after the runner's)."""

    def info(self) -> dict[str, Any]:
        """Its figures for stats.json."""
        return {"verify_width_steps": None}


def make_speculator(
    draft: DFlashDraft | None,
    runner: ModelRunner,
    choice: BackendChoice,
    config: EngineConfig,
    tp: TensorParallel | None,
) -> Speculator:
    """The runner's speculator (set on it: its forwards hand features to it)."""
    speculator = Speculator()
    if draft is not None:
        speculator = DFlashSpeculator(
            draft,
            runner,
            choice.backend,
            choice.window_backend,
            verify_width=config.verify_width,
            max_batch_size=config.max_batch_size,
            tp=tp,
        )
    runner.speculator = speculator
    return speculator


class DFlashSpeculator(Speculator):
    def __init__(
        self,
        draft: DFlashDraft,
        runner: ModelRunner,
        backend: AttentionBackend,
        window_backend: AttentionBackend | None,
        verify_width: int | str,
        max_batch_size: int,
        tp: TensorParallel | None = None,
    ) -> None:
        """window_backend: a second backend of the same kind, planned for the draft's
        sliding-window layers (their blocks read their ring, through a window)."""
        self.draft, self.runner, self.tp = draft, runner, tp
        self.backend, self.window_backend = backend, window_backend
        self.drafting = True
        self.block_size = block = draft.block_size
        self.widths = verify_widths(verify_width, block)
        self.capture_layers = draft.target_layer_ids
        window = draft.attention.window
        # A sliding draft's first block reads back the W - 1 positions before its anchor.
        self.recompute_tail = max(window - 1, 1) if window else 1
        device, page_size = runner.device, runner.page_size
        max_pages = pages_for(runner.max_kv, page_size)
        # A full-attention layer's cache is indexed by the target's page tables: position i of
        # a request lives at the same cache index in both. A sliding layer's lives in its ring.
        self.ring = None
        if window is not None:
            self.ring = DraftRing(max_batch_size, max_pages, window, block, page_size, device)
        shape, dtype = draft.shape, runner.model.lm_head.weight.dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for sliding in draft.attention.sliding:
            pages = self.ring.num_pages if sliding and self.ring else runner.num_pages
            self.kv_caches += allocate_kv(
                1, pages, page_size, shape.num_kv_heads, shape.head_dim, dtype, device
            )
        self.context = DraftContext.zeros(runner.state.num_slots + 1, device)
        self.drafts = torch.zeros(max_batch_size, block - 1, dtype=torch.int64, device=device)
        self.features: torch.Tensor | None = None  # the last target forward's captured rows
        self.ctx_features: torch.Tensor | None = None  # the draft graph's context buffer
        self.graphs: GraphSet | None = None
        # The last verify's committed rows are not yet in the draft's context: the next step
        # stores them, by drafting or, at width 1, on their own.
        self._verified_unstored = False
        self.policy: WidthPolicy | None = None
        self.width_steps: Counter[int] = Counter()  # verify width -> steps decoding at it
        self._last_width = 0  # the width of the step read back before

    # -- the width ----------------------------------------------------------------------------

    def start_job(self, max_batch_size: int, max_batched_tokens: int) -> None:
        self.max_batch_size, self.max_batched_tokens = max_batch_size, max_batched_tokens
        many = len(self.widths) > 1
        self.policy = WidthPolicy(self.block_size, self.widths) if many else None
        self.width_steps = Counter()
        self._last_width = 0

    def next_width(self, running: int, prefill_pending: bool) -> int:
        if self.pinned_width is not None or self.policy is None:
            return self.pinned_width or self.widths[-1]
        width = step_width(
            self.policy,
            bucket=ladder_bucket(running, self.max_batch_size),
            running=running,
            prefill_pending=prefill_pending,
            max_batched_tokens=self.max_batched_tokens,
        )
        if self.tp is not None:  # chosen from this rank's step times: rank 0's wins
            width = self.tp.first_int(width)
        return width

    def learn(self, plan: StepPlan, accepted: list[int], seconds: float) -> None:
        """Feeds the policy: the rounds' acceptance, and the step's cost when every request
        decoded (a step with prefill chunks says little about a width's cost) and the width
        was the last step's too (a switch costs the pipeline more than the width does)."""
        width, switched = plan.width, plan.width != self._last_width
        self._last_width = width
        if plan.num_decoding:
            self.width_steps[width] += 1
        policy = self.policy
        if policy is None:
            return
        for a in accepted if width > 1 else ():
            policy.record_round(width, a)
        if seconds > 0 and not switched:
            policy.record_rows(plan.num_rows, seconds * 1e3)
            if plan.uniform:
                bucket = ladder_bucket(plan.num_live, self.max_batch_size)
                policy.record_cost(width, bucket, seconds * 1e3)

    def aborted(self) -> None:
        self._last_width = 0

    # -- a step -------------------------------------------------------------------------------

    def admit(self, requests: list[Request], slots: torch.Tensor) -> None:
        self.context.admit(slots)
        if self.oracle is not None:
            self.oracle.admit(requests, slots)

    @torch.inference_mode()
    def propose(self, args: StepArgs, plan: StepPlan) -> torch.Tensor | None:
        """Drafts one block per decoding request, after storing the context K/V of the rows
        their last verify committed; at width 1 it only stores those."""
        d, width = plan.num_decoding, plan.width
        if not d:
            return None
        if width == 1:
            if self._verified_unstored:
                self._store_verified(args.slot[:d])
            return None
        drafts = self._draft_step(args, plan)
        if self.oracle is not None:  # in place: a graph's target reads them there
            self.oracle.rewrite(drafts, args.slot[:d], self.runner.state.out_len)
        return drafts[:, : width - 1]

    def graph_drafts(self, size: int) -> torch.Tensor:
        return self.drafts[:size]

    def store_context(self, features: torch.Tensor, inputs: TargetInputs) -> None:
        window_kv_index = None
        if self.ring is not None:  # a chunk's rows, up to the ring's last positions
            end = inputs.meta.kv_lens.long()[inputs.row_req]
            committed = inputs.context_kv_index >= 0
            window_kv_index = self.ring.kv_index(
                inputs.row_slot, inputs.meta.positions, end, committed
            )
        self.draft.write_context(
            features,
            inputs.meta.positions,
            inputs.context_kv_index,
            window_kv_index,
            self.backend,
            self.kv_caches,
        )

    def observe(self, features: torch.Tensor | None) -> None:
        self.features = features

    def accept(
        self, drafts: torch.Tensor | None, tokens: torch.Tensor, plan: StepPlan
    ) -> torch.Tensor:
        d = plan.num_decoding
        if drafts is None:
            return tokens.new_zeros(d)
        return accepted_lengths(drafts, tokens[: d * plan.width].view(d, plan.width))

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor, plan: StepPlan) -> None:
        self._verified_unstored = self.context.commit(slots, accepted, plan.width)

    def _draft_step(self, args: StepArgs, plan: StepPlan) -> torch.Tensor:
        d = plan.num_decoding
        graphs = self.graphs
        graphed = plan.uniform and graphs is not None and plan.num_requests in graphs
        slots = args.slot if graphed else args.slot[:d]
        context = self._verified_context(slots)
        self._verified_unstored = False
        if graphed:
            assert graphs is not None and self.ctx_features is not None
            if context is not None:
                self.ctx_features[: context.shape[0]].copy_(context)
            size = plan.num_requests
            self.runner.replays["draft", size] += 1
            metas = partial(self._metas, slots)
            with self.runner.replay_scope(self._graph_backends(), "draft", size, metas):
                return graphs.replay(size)[0][:d]
        # Eager: the blocks end by the step's longest context, with a block, not the graphs'.
        return self._draft(slots, context, plan.max_kv - plan.width + self.block_size)

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
        runner = self.runner
        return draft_inputs(
            runner.state,
            self.context,
            slots,
            self.block_size,
            self.draft.mask_token_id,
            runner.page_size,
            max_kv or runner.max_kv,
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
        return self.draft.draft_block(
            self.runner.model,
            inputs.block_ids,
            inputs.meta.positions,
            self.backend,
            self.window_backend,
            self.kv_caches,
        )

    # -- CUDA graphs --------------------------------------------------------------------------

    def capture_graphs(self, max_batch_size: int, max_batched_tokens: int, pool: Any) -> None:
        """The draft's block at the sizes of the narrowest drafting width's target graphs."""
        drafting = [w for w in self.widths if w > 1]
        if not drafting:
            return
        runner, block = self.runner, self.block_size
        sizes = graph_sizes(max_batch_size, min(drafting), max_batched_tokens)
        hidden = runner.model.shape.hidden_size
        self.ctx_features = torch.zeros(
            max_batch_size * block,
            hidden * len(self.capture_layers),
            dtype=runner.model.lm_head.weight.dtype,
            device=runner.device,
        )
        self.graphs = GraphSet("draft", self._draft_graph, runner.clear, runner.device)
        scope = runner.capture_scope(self._graph_backends(), "draft", block)
        self.graphs.capture(sizes, pool, scope)

    def _graph_backends(self) -> list[AttentionBackend]:
        """The backends that attend in the draft's graphs, in the order of `_metas`: the full
        layers', then the sliding ones'."""
        full = [self.backend] if self.draft.attention.num_full else []
        return full + ([self.window_backend] if self.window_backend is not None else [])

    def _metas(self, slots: torch.Tensor) -> list[AttentionMeta]:
        inputs = self._inputs(slots)
        metas = [inputs.meta] if self.draft.attention.num_full else []
        return metas + ([inputs.window_meta] if inputs.window_meta is not None else [])

    def _draft_graph(self, size: int) -> tuple[torch.Tensor, ...]:
        assert self.ctx_features is not None
        slots = self.runner.head(size).slot
        drafts = self._draft(slots, self.ctx_features[: size * self.block_size])
        self.drafts[:size].copy_(drafts)  # the target graph reads them here
        return (self.drafts[:size],)

    def info(self) -> dict[str, Any]:
        return {"verify_width_steps": dict(sorted(self.width_steps.items())) or None}
