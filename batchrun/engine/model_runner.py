"""The model runner: owns the target and draft models, their paged KV pools, the per-slot
device state, the attention backend and the CUDA graphs, and runs a step's forwards.

A step arrives as one packed host array (engine/step_inputs.py), copied once into a persistent
device buffer; everything else is built on the device from it and the slots' state. A step in
which every request decodes (plain decode: 1 row each; DFlash: a draft block and a verify of W
rows each, W up to the block size B) replays CUDA graphs captured for its width and the smallest
batch size that holds it, input building included; any other step (prefill chunks mixed in)
runs the same code eagerly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from batchrun.attention.base import AttentionBackend, GraphShape, HostPlanned
from batchrun.attention.meta import AttentionMeta, allocate_kv
from batchrun.engine.cuda_graphs import GraphSet, graph_rows, graph_sizes
from batchrun.engine.device_state import DeviceState, staged
from batchrun.engine.page_pool import pages_for
from batchrun.engine.step_inputs import (
    StepArgs,
    StepPlan,
    TargetInputs,
    step_args,
    target_inputs,
)
from batchrun.models.dflash import DFlashDraft
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.speculative.drafter import DraftInputs, context_feature_rows, draft_inputs
from batchrun.speculative.sliding_window import DraftRing

IN_FLIGHT_STEPS = 2  # a request's pages cover the step being read back and the one launched


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [N, V] float32, the sampled rows (a graph step: every padded row)
    row_slot: torch.Tensor  # [N] the slot each row samples for
    row_step: torch.Tensor  # [N] the output-token index it draws
    hidden: torch.Tensor | None = None  # an eager step's every row, pre-norm (prompt logprobs)


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        draft: DFlashDraft | None,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
        max_batch_size: int,
        max_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
        window_backend: AttentionBackend | None = None,
    ) -> None:
        """window_backend: a second backend of the same kind, planned for a draft's
        sliding-window layers (its blocks read their ring, through a window)."""
        s = model.shape
        self.model, self.draft, self.backend = model, draft, backend
        self.window_backend = window_backend
        self.device, self.page_size, self.num_pages = device, page_size, num_pages
        self.max_batched_tokens = max_batched_tokens
        self.width = draft.block_size if draft is not None else 1
        dtype = model.lm_head.weight.dtype
        self.kv_caches = allocate_kv(
            s.num_layers, num_pages, page_size, s.num_kv_heads, s.head_dim, dtype, device
        )
        self.capture_layers = draft.target_layer_ids if draft is not None else ()
        # Positions a step can touch: the context, the step being read back and this one.
        self.max_kv = max_model_len + IN_FLIGHT_STEPS * self.width
        max_pages = pages_for(self.max_kv, page_size)
        # A full-attention draft layer's cache is indexed by the target's page tables: position
        # i of a request lives in the same slot of both. A sliding layer's lives in its ring.
        self.draft_kv = []
        self.ring: DraftRing | None = None
        if draft is not None:
            d, attention = draft.shape, draft.attention
            if attention.window is not None:
                self.ring = DraftRing(
                    max_batch_size, max_pages, attention.window, self.width, page_size, device
                )
            for sliding in attention.sliding:
                pages = self.ring.num_pages if sliding and self.ring else num_pages
                self.draft_kv += allocate_kv(
                    1, pages, page_size, d.num_kv_heads, d.head_dim, dtype, device
                )
        self.state = DeviceState(max_batch_size, max_pages, s.vocab_size, device)
        self.step_in = torch.zeros(
            step_in_size(max_batch_size, max_batched_tokens, max_pages),
            dtype=torch.int64, device=device,
        )  # fmt: skip
        self.drafts = torch.zeros(max_batch_size, max(self.width - 1, 1), dtype=torch.int64,
                                  device=device)  # fmt: skip
        self.ctx_features: torch.Tensor | None = None  # [rows, layers * H], for the draft graph
        self.features: torch.Tensor | None = None  # the last target forward's captured rows
        self.target_graphs: dict[int, GraphSet] = {}  # verify width -> its graphs
        self.graph_logits: torch.Tensor | None = None  # every target graph's logits, [rows, V]
        self.draft_graphs: GraphSet | None = None
        # The last verify's committed rows are not yet in the draft's context (a draft forward,
        # or at width 1 write_pending_context, stores them).
        self.context_pending = False
        self.replays: Counter[tuple[str, int]] = Counter()  # (graph set, batch size) -> replays

    # -- CUDA graphs --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_graphs(self, max_batch_size: int, widths: tuple[int, ...] = (1,)) -> None:
        """Capture the steady-state step at each verify width for every ladder size up to
        max_batch_size (off a GPU: emulate them, for tests)."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        rows = graph_rows(max_batch_size, widths, self.max_batched_tokens)
        vocab = self.model.lm_head.weight.shape[0]  # a tensor-parallel rank's: its slice
        self.graph_logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        sizes: list[int] = []
        for width in sorted(widths, reverse=True):
            name = f"target{width}"
            graphs = GraphSet(
                name, partial(self._target_graph, width=width), self._clear, self.device
            )
            sizes = graph_sizes(max_batch_size, width, self.max_batched_tokens)
            graphs.capture(sizes, pool, self._capture_scope(name, width))
            self.target_graphs[width] = graphs
        if self.draft is not None and max(widths) > 1:  # at the narrowest drafting width's sizes
            narrowest = min(w for w in widths if w > 1)
            sizes = graph_sizes(max_batch_size, narrowest, self.max_batched_tokens)
            rows, width = max_batch_size * self.width, self.model.shape.hidden_size
            self.ctx_features = torch.zeros(
                rows, width * len(self.capture_layers), dtype=self.model.lm_head.weight.dtype,
                device=self.device,
            )  # fmt: skip
            self.draft_graphs = GraphSet("draft", self._draft_graph, self._clear, self.device)
            self.draft_graphs.capture(sizes, pool, self._capture_scope("draft", self.width))

    def _graph_backends(self, name: str) -> list[HostPlanned]:
        """The host-planned backends that attend in graph `name`, in the order of its metas
        (`_draft_metas`): a draft's full layers, then its sliding ones."""
        if name != "draft":
            found = [self.backend]
        else:
            assert self.draft is not None
            full, window = self.draft.attention.num_full > 0, self.window_backend
            found = ([self.backend] if full else []) + ([window] if window is not None else [])
        return [cast(HostPlanned, b) for b in found if b.host_planned]

    def _capture_scope(
        self, name: str, q_len: int
    ) -> Callable[[int], AbstractContextManager[Any]] | None:
        """Host-planned backends' scopes around a graph's capture (None for the others)."""
        backends = self._graph_backends(name)
        if not backends:
            return None

        def scope(size: int) -> ExitStack:
            stack = ExitStack()
            shape = GraphShape(size, q_len, self.max_kv, self.page_size)
            for backend in backends:
                stack.enter_context(backend.capturing((name, size), shape))
            return stack

        return scope

    def _replay_scope(
        self, name: str, size: int, metas: Callable[[], list[AttentionMeta]]
    ) -> AbstractContextManager[Any]:
        """Host-planned backends plan a replay from the step's metas, built eagerly by the
        same code the graph runs."""
        stack = ExitStack()
        backends = self._graph_backends(name)
        for backend, meta in zip(backends, metas() if backends else [], strict=True):
            stack.enter_context(backend.replaying((name, size), meta))
        return stack

    def graph_size(self, num_requests: int, width: int) -> int | None:
        """The graph size a step of num_requests decoding requests replays at (None: eager)."""
        graphs = self.target_graphs.get(width)
        return graphs.bucket(num_requests) if graphs is not None else None

    def _clear(self, size: int) -> None:
        """A step of `size` padding requests (the state graphs are captured in)."""
        head = self.step_in[: 4 * size].view(4, size)
        head.zero_()
        head[0] = self.state.num_slots

    def _head(self, size: int) -> StepArgs:
        head = self.step_in[: 4 * size].view(4, size)
        empty = self.step_in[:0]
        return StepArgs(head[0], head[1], head[2], head[3], empty.view(3, 0), empty, None)

    # -- a step -------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> StepArgs:
        """The step's one host-to-device copy; new page-table entries applied."""
        packed = staged(torch.from_numpy(plan.packed), self.device)
        self.step_in[: packed.shape[0]].copy_(packed, non_blocking=True)
        args = step_args(self.step_in, plan)
        self.state.add_pages(args.updates)
        return args

    @torch.inference_mode()
    def draft_step(self, args: StepArgs, plan: StepPlan) -> torch.Tensor:
        """Drafts [D, B-1] for the step's D decoding requests, after storing the context K/V
        of the rows their last verify committed."""
        assert self.draft is not None
        num_dec = plan.num_decoding
        graphed = (
            plan.uniform
            and self.draft_graphs is not None
            and plan.num_requests in self.draft_graphs
            and self.ctx_features is not None
        )
        slots = args.slot if graphed else args.slot[:num_dec]
        context = self._context(slots)
        self.context_pending = False
        if graphed:
            assert self.draft_graphs is not None and self.ctx_features is not None
            if context is not None:
                self.ctx_features[: context.shape[0]].copy_(context)
            size = plan.num_requests
            self.replays["draft", size] += 1
            with self._replay_scope("draft", size, partial(self._draft_metas, slots)):
                return self.draft_graphs.replay(size)[0][:num_dec]
        # Eager: the blocks end by the step's longest context, with a block, not the graphs'.
        return self._draft(slots, context, plan.max_kv - plan.width + self.width)

    @torch.inference_mode()
    def write_pending_context(self, args: StepArgs, plan: StepPlan) -> None:
        """Store the draft context of the last verify's committed rows without drafting: a
        step of width 1 after a wider one."""
        assert self.draft is not None
        slots = args.slot[: plan.num_decoding]
        context = self._context(slots)
        if context is not None:
            self._write_context(context, self._draft_inputs(slots))
        self.context_pending = False

    def _context(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The features of the rows each request's last verify committed, W rows per request."""
        if self.features is None:
            return None
        rows = context_feature_rows(self.state, slots, self.width, self.features.shape[0])
        return self.features.index_select(0, rows)

    def _draft_inputs(self, slots: torch.Tensor, max_kv: int | None = None) -> DraftInputs:
        assert self.draft is not None
        return draft_inputs(
            self.state, slots, self.width, self.draft.mask_token_id, self.page_size,
            max_kv or self.max_kv, self.draft.attention, self.ring,
        )  # fmt: skip

    def _write_context(self, context: torch.Tensor, inputs: DraftInputs) -> None:
        assert self.draft is not None
        self.draft.write_context(
            context, inputs.ctx_positions, inputs.ctx_slots, inputs.ctx_window_slots,
            self.backend, self.draft_kv,
        )  # fmt: skip

    def _draft(
        self, slots: torch.Tensor, context: torch.Tensor | None, max_kv: int | None = None
    ) -> torch.Tensor:
        assert self.draft is not None
        inputs = self._draft_inputs(slots, max_kv)
        if context is not None:
            self._write_context(context, inputs)
        if self.draft.attention.num_full:
            self.backend.plan(inputs.meta)
        if inputs.window_meta is not None:
            assert self.window_backend is not None, "sliding draft layers need window_backend"
            self.window_backend.plan(inputs.window_meta)
        return self.draft.draft_block(
            self.model, inputs.block_ids, inputs.meta.positions, self.backend,
            self.window_backend, self.draft_kv,
        )  # fmt: skip

    def _draft_graph(self, size: int) -> tuple[torch.Tensor, ...]:
        assert self.ctx_features is not None
        slots = self._head(size).slot
        drafts = self._draft(slots, self.ctx_features[: size * self.width])
        self.drafts[:size].copy_(drafts)  # the target graph reads them here
        return (self.drafts[:size],)

    @torch.inference_mode()
    def target_step(
        self, args: StepArgs, plan: StepPlan, drafts: torch.Tensor | None
    ) -> TargetOutput:
        """The target over the step's rows: logits of the rows to sample. A DFlash target also
        keeps its captured features (the draft's next context) and stores at once the draft
        context of the rows already committed (prefill chunks; at width 1, every row)."""
        width = plan.width
        self.context_pending = self.draft is not None and width > 1 and plan.num_decoding > 0
        graphs = self.target_graphs.get(width)
        if plan.uniform and graphs is not None and plan.num_requests in graphs:
            size = plan.num_requests
            metas = partial(self._graph_target_metas, size, width)
            with self._replay_scope(graphs.name, size, metas):
                logits, row_slot, row_step, *features = graphs.replay(size)
            self.replays[graphs.name, size] += 1
            self.features = features[0] if features else None
            return TargetOutput(logits, row_slot, row_step)
        chunks = plan.num_rows > plan.num_decoding * width
        inputs = target_inputs(
            args, self.state, drafts, plan.num_rows, width, self.page_size, plan.max_q,
            plan.max_kv, mixed_decoding=plan.num_decoding if chunks else 0,
        )  # fmt: skip
        hidden, self.features = self._forward(inputs, chunks or width == 1)
        row_slot, row_step, sampled = inputs.row_slot, inputs.row_step, hidden
        if args.logit_rows is not None:
            rows = args.logit_rows
            sampled, row_slot, row_step = hidden[rows], row_slot[rows], row_step[rows]
        return TargetOutput(self.model.logits(sampled), row_slot, row_step, hidden)

    def _forward(
        self, inputs: TargetInputs, store_context: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.backend.plan(inputs.meta)
        hidden, features = self.model(
            inputs.ids, inputs.meta.positions, self.backend, self.kv_caches, self.capture_layers
        )
        if self.draft is not None and features is not None and store_context:
            window_slots = None
            if self.ring is not None:  # a chunk's rows, up to the ring's last positions
                end = inputs.meta.kv_lens.long()[inputs.row_req]
                committed = inputs.context_slots >= 0
                window_slots = self.ring.slots(
                    inputs.row_slot, inputs.meta.positions, end, committed
                )
            self.draft.write_context(
                features, inputs.meta.positions, inputs.context_slots, window_slots,
                self.backend, self.draft_kv,
            )  # fmt: skip
        return hidden, features

    def _graph_target_inputs(self, size: int, width: int) -> TargetInputs:
        return target_inputs(
            self._head(size), self.state, self.drafts[:size], size * width, width,
            self.page_size, width, self.max_kv,
        )  # fmt: skip

    def _graph_target_metas(self, size: int, width: int) -> list[AttentionMeta]:
        return [self._graph_target_inputs(size, width).meta]

    def _draft_metas(self, slots: torch.Tensor) -> list[AttentionMeta]:
        """The draft graph's metas, as `_graph_backends` orders them."""
        assert self.draft is not None
        inputs = self._draft_inputs(slots)
        metas = [inputs.meta] if self.draft.attention.num_full else []
        return metas + ([inputs.window_meta] if inputs.window_meta is not None else [])

    def _target_graph(self, size: int, width: int) -> tuple[torch.Tensor, ...]:
        inputs = self._graph_target_inputs(size, width)
        hidden, features = self._forward(inputs, store_context=width == 1)
        # Every graph writes its logits into one buffer outside the pool: each graph's own
        # would stay allocated for its replays (17 GB at the 8B's vocabulary, batch 256).
        assert self.graph_logits is not None  # allocated before any capture
        logits = self.model.logits(hidden, out=self.graph_logits[: size * width])
        outputs = (logits, inputs.row_slot, inputs.row_step)
        return outputs if features is None else (*outputs, features)


def step_in_size(max_batch_size: int, max_batched_tokens: int, max_pages: int) -> int:
    """The packed step's largest size: request fields, the page-table entries a step can add
    (a request admitted onto a cached prefix receives a whole table at once, and each entry is
    sent once), chunk ids and logit rows."""
    return 4 * max_batch_size + 3 * max_batch_size * max_pages + 2 * max_batched_tokens
