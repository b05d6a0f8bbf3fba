"""The model runner: owns the target model, its paged KV pool, the attention backend and the
target's CUDA graphs, and runs the target's forward of a step over the per-slot device state
(the worker's: engine/worker.py).

A step arrives as one packed host array (its layout: engine/step_inputs.py), copied once into a
persistent device buffer; everything else is built on the device from it and the slots' state.
A step in which every request decodes (each its own W_r rows: its anchor, then W_r - 1 drafts)
replays a CUDA graph, input building included (a hybrid target's linear layers too: their slots
by the step's, padding in the scratch slot); any other step (prefill chunks mixed in) runs the
same code eagerly. The graphs are keyed by requests and total rows, not by a width: a set per
verify width w holds size * w rows for each ladder size, and any request may have up to the
job's widest width of them (`graph_shape`). So a step whose rows verify at different widths
pays for the rows it has (rounded up to the next w), not for its widest row times its
requests, which a graph captured at the widest width per request would. What drafting needs happens
in the speculator the runner builds (spec_decode/), handing it a view of the target; the forward
hands it the features of rows it commits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.kv_dtype import FP8, kv_dtype, kv_scales
from batchrun.attention.meta import AttentionMeta, allocate_kv
from batchrun.device import staged
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.page_pool import pages_for
from batchrun.engine.cuda_graphs import GraphHost, GraphSet, graph_rows
from batchrun.engine.device_state import DeviceState
from batchrun.engine.linear_slots import LinearSlots
from batchrun.engine.step_inputs import (
    IN_FLIGHT_STEPS,
    MixedDecoding,
    StepArgs,
    StepPlan,
    TargetInputs,
    graph_step_args,
    step_args,
    step_in_size,
    target_inputs,
)
from batchrun.layers.attention import PagedAttention
from batchrun.layers.linear_attention import LinearStepMeta
from batchrun.models.families import is_hybrid, paged_layers
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.models.qwen3_5 import Qwen3_5ForCausalLM
from batchrun.spec_decode.base import Speculator, TargetView


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [N, V] float32, the sampled rows (a graph step: every padded row)
    row_slot: torch.Tensor  # [N] the slot each row samples for
    row_step: torch.Tensor  # [N] the output-token index it draws
    features: torch.Tensor | None  # every row's hidden states at the speculator's layers
    hidden: torch.Tensor | None = None  # an eager step's every row, pre-norm (prompt logprobs)
    linear: LinearStepMeta | None = None  # a hybrid target's step: its slots, for the commit
    replayed: bool = False  # a CUDA graph ran the forward


@dataclass(frozen=True)
class RunnerSizes:
    num_pages: int  # of the KV pool
    page_size: int
    max_batch_size: int  # requests (slots) at once
    max_batched_tokens: int  # rows a forward may take
    max_model_len: int  # positions a request may reach
    block_size: int = 1  # rows a decoding request may feed a step (a draft's block)

    @property
    def max_kv(self) -> int:
        """Positions a step can touch: the context, the step being read back and this one."""
        return self.max_model_len + IN_FLIGHT_STEPS * self.block_size

    @property
    def max_pages(self) -> int:
        """A slot's page-table columns."""
        return pages_for(self.max_kv, self.page_size)

    @classmethod
    def of(
        cls, config: EngineConfig, num_pages: int, max_model_len: int, block_size: int
    ) -> RunnerSizes:
        return cls(
            num_pages=num_pages,
            page_size=config.page_size,
            max_batch_size=config.batch_size,
            max_batched_tokens=config.max_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
        )


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        backend: AttentionBackend,
        sizes: RunnerSizes,
        state: DeviceState,
        kv_cache_dtype: str = "auto",
        speculate: Callable[[TargetView], Speculator] | None = None,
    ) -> None:
        """state: the per-slot device state the steps read (its owner's, engine/worker.py);
        kv_cache_dtype: the pool's, auto (the model dtype) or fp8 (attention/kv_dtype.py);
        speculate: builds the speculator from a view of the target (None: plain decoding)."""
        device = state.device
        s = model.shape
        self.model, self.backend, self.device = model, backend, device
        self.page_size, self.num_pages = sizes.page_size, sizes.num_pages
        self.max_batched_tokens = sizes.max_batched_tokens
        pool = (sizes.num_pages, sizes.page_size, s.num_kv_heads, s.head_dim)
        self.kv_dtype = dtype = kv_dtype(kv_cache_dtype, model.lm_head.weight.dtype)
        paged = paged_layers(s)  # a hybrid's linear layers hold state slots, not pages
        self.kv_caches = allocate_kv(paged, *pool, dtype, device)
        # A hybrid target's recurrent state, a slot per device-state slot (None: every layer
        # attends over the pages).
        self.linear: LinearSlots | None = None
        if is_hybrid(s):
            assert isinstance(model, Qwen3_5ForCausalLM)
            width = sizes.block_size
            self.linear = LinearSlots(model, self.kv_caches, state.num_slots, width, device)
        # An FP8 pool's per-layer scales, [layers, 2] (None: the model dtype's pool).
        self.kv_scales = kv_scales(paged, device) if dtype == FP8 else None
        _bind_kv_scales(model, self.kv_scales)
        self.max_kv, max_pages = sizes.max_kv, sizes.max_pages
        self.state = state
        words = step_in_size(sizes.max_batch_size, sizes.max_batched_tokens, max_pages)
        self.step_in = torch.zeros(words, dtype=torch.int64, device=device)
        self.graph_host = GraphHost(
            self.step_in,
            scratch_slot=self.state.num_slots,
            max_kv=self.max_kv,
            page_size=self.page_size,
            max_batched_tokens=self.max_batched_tokens,
        )
        self.replays = self.graph_host.replays  # (graph set, batch size) -> replays
        self.target_graphs: dict[int, GraphSet] = {}  # w -> graphs of size * w rows
        self.graph_max_q = 1  # the most rows a request may have in a drafting graph
        # Width 1 capturing no features: steps while the speculator writes no context.
        self.quiet_graphs: GraphSet | None = None
        self.graph_logits: torch.Tensor | None = None  # every target graph's logits, [rows, V]
        view = TargetView(
            model=model,
            state=self.state,
            device=device,
            page_size=self.page_size,
            num_pages=self.num_pages,
            max_kv=self.max_kv,
            max_pages=max_pages,
            graphs=self.graph_host,
        )
        self.speculator = speculate(view) if speculate is not None else Speculator()

    # -- CUDA graphs --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_graphs(self, max_batch_size: int, widths: tuple[int, ...] = (1,)) -> None:
        """Capture the steady-state step at each verify width for every ladder size up to
        max_batch_size, then the speculator's graphs (off a GPU: emulate them, for tests)."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        rows = graph_rows(max_batch_size, widths, self.max_batched_tokens)
        vocab = self.model.lm_head.weight.shape[0]  # a tensor-parallel rank's: its slice
        self.graph_logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        self.graph_max_q = max(widths)
        for width in sorted(widths, reverse=True):
            self.target_graphs[width] = self.graph_host.capture(
                f"target{width}",
                partial(self._target_graph, width=width),
                self.graph_host.sizes(max_batch_size, width),
                ([self.backend], width),
                pool,
            )
        if 1 in widths and self.speculator.capture_layers:
            self.quiet_graphs = self.graph_host.capture(
                "target1-quiet",
                partial(self._target_graph, width=1, capture=False),
                self.graph_host.sizes(max_batch_size, 1),
                ([self.backend], 1),
                pool,
            )
        self.speculator.capture_graphs(max_batch_size, pool)

    def graph_shape(self, widths: list[int]) -> tuple[int, int] | None:
        """The requests and rows of the graph that a step of decoding requests with these
        rows each replays (None: eager): a step that verifies no draft replays the width-1
        graphs; one that does, the set of the fewest rows that hold its own (its requests'
        ladder size times w), as long as no request has more rows than a graph's may."""
        n, rows, widest = len(widths), sum(widths), max(widths, default=1)
        sets = [1] if widest == 1 else [w for w in sorted(self.target_graphs) if w > 1]
        if widest > self.graph_max_q:
            return None
        for w in sets:
            graphs = self.target_graphs.get(w)
            size = graphs.bucket(n) if graphs is not None else None
            if size is not None and size * w >= rows:
                return size, size * w
        return None

    # -- a step -------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> StepArgs:
        """The step's one host-to-device copy; new page-table entries applied."""
        packed = staged(torch.from_numpy(plan.packed), self.device)
        self.step_in[: packed.shape[0]].copy_(packed, non_blocking=True)
        args = step_args(self.step_in, plan)
        self.state.add_pages(args.updates)
        return args

    @torch.inference_mode()
    def target_step(
        self, args: StepArgs, plan: StepPlan, drafts: torch.Tensor | None
    ) -> TargetOutput:
        """The target over the step's rows: the logits of the rows to sample, and the features
        the speculator reads."""
        drafting = plan.drafting
        chunks = not plan.uniform
        # A dormant drafter's decode steps (width 1, no context written): no features to capture
        # either. Prompts' context is written still: a probe then sees every row's prompt.
        speculator = self.speculator
        quiet = (
            not drafting
            and not chunks
            and bool(speculator.capture_layers)
            and not speculator.writes_context
        )
        shape = self.graph_shape(list(plan.widths)) if plan.uniform else None
        padded = shape == (plan.num_requests, plan.num_rows)
        width = plan.num_rows // max(plan.num_requests, 1)  # a graph's w
        graphs = self.quiet_graphs if quiet else self.target_graphs.get(width)
        if padded and graphs is not None and self.graph_host.replayable(graphs, plan):
            size = plan.num_requests
            metas = partial(self._graph_target_metas, size, width)
            replayed = self.graph_host.replay(graphs, size, [self.backend], metas)
            logits, row_slot, row_step, *captured = replayed
            # The commit reads the live requests' kept rows: they lead the graph's scratch rows.
            linear = self.linear.meta(plan, args) if self.linear is not None else None
            features = captured[0] if captured else None
            return TargetOutput(logits, row_slot, row_step, features, linear=linear, replayed=True)
        mixed = None
        if chunks and plan.num_decoding:
            mixed = MixedDecoding(plan.num_decoding, plan.decode_rows, plan.max_width)
        inputs = target_inputs(
            args,
            self.state,
            drafts,
            num_rows=plan.num_rows,
            drafting=drafting,
            page_size=self.page_size,
            max_q=plan.max_q,
            max_kv=plan.max_kv,
            mixed=mixed,
        )
        store = chunks or not drafting
        linear = None
        if self.linear is not None:  # reused prefixes' states in, stored boundaries' out
            linear = self.linear.meta(plan, args)
            self.linear.restore(plan)
        hidden, features = self._forward(inputs, store, capture=not quiet, linear=linear)
        if self.linear is not None:
            self.linear.store(plan)
        row_slot, row_step, sampled = inputs.row_slot, inputs.row_step, hidden
        if args.logit_rows is not None:
            rows = args.logit_rows
            sampled, row_slot, row_step = hidden[rows], row_slot[rows], row_step[rows]
        logits = self.model.logits(sampled)
        return TargetOutput(logits, row_slot, row_step, features, hidden, linear)

    def commit_linear(self, out: TargetOutput, accepted: torch.Tensor) -> None:
        """A hybrid target's verify step, after acceptance (accepted [D] on the device): its
        linear layers' slots take the state of the rows kept. Nothing for other targets."""
        if self.linear is not None and out.linear is not None:
            self.linear.commit(out.linear, accepted)

    def _forward(
        self,
        inputs: TargetInputs,
        store_context: bool,
        capture: bool = True,
        linear: LinearStepMeta | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """store_context: the rows the step commits as it runs (prefill chunks; in a step that
        verifies no draft, every row) go to the speculator's context now; capture: the
        speculator's features are taken at all; linear: a hybrid target's step meta (its linear
        layers' slots)."""
        self.backend.plan(inputs.meta)
        layers = self.speculator.capture_layers if capture else ()
        ids, positions = inputs.ids, inputs.meta.positions
        if linear is None:
            hidden, features = self.model(ids, positions, self.backend, self.kv_caches, layers)
        else:
            assert self.linear is not None
            hidden, features = self.linear.forward(ids, positions, self.backend, layers, linear)
        if features is not None and store_context:
            self.speculator.store_context(features, inputs)
        return hidden, features

    def _graph_max_q(self, width: int) -> int:
        """The most rows a request has in the graphs of w = width (1: no draft verified)."""
        return 1 if width == 1 else self.graph_max_q

    def _graph_target_inputs(self, size: int, width: int) -> TargetInputs:
        return target_inputs(
            graph_step_args(self.step_in, size),
            self.state,
            self.speculator.graph_drafts(size) if width > 1 else None,
            num_rows=size * width,
            drafting=width > 1,
            page_size=self.page_size,
            max_q=self._graph_max_q(width),
            max_kv=self.max_kv,
        )

    def _graph_target_metas(self, size: int, width: int) -> list[AttentionMeta]:
        return [self._graph_target_inputs(size, width).meta]

    def _target_graph(
        self, size: int, width: int, capture: bool = True
    ) -> tuple[torch.Tensor, ...]:
        inputs = self._graph_target_inputs(size, width)
        linear = None
        if self.linear is not None:  # padding requests' rows run in the scratch slot's state
            args = graph_step_args(self.step_in, size)
            max_q = self._graph_max_q(width)
            linear = self.linear.graph_meta(args.slot, args.q_len, max_q, size * width)
        hidden, features = self._forward(
            inputs, store_context=width == 1, capture=capture, linear=linear
        )
        # Every graph writes its logits into one buffer outside the pool: each graph's own
        # would stay allocated for its replays (17 GB at the 8B's vocabulary, batch 256).
        assert self.graph_logits is not None  # allocated before any capture
        logits = self.model.logits(hidden, out=self.graph_logits[: size * width])
        outputs = (logits, inputs.row_slot, inputs.row_step)
        return outputs if features is None else (*outputs, features)


def _bind_kv_scales(model: Qwen3ForCausalLM, scales: torch.Tensor | None) -> None:
    """Each target attention layer reads its pool's scales (row i of `scales`) where it writes
    and attends; None: its pool is in the model dtype. A model serves the pools of the runner
    built last (`batchrun bench` builds one engine after another on one model)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert scales is None or len(layers) == scales.shape[0], "one attention per layer"
    for i, layer in enumerate(layers):
        layer.kv_scale = None if scales is None else scales[i]
