"""The model runner: owns the target and draft models, their paged KV pools, the attention
backend and the CUDA graphs, and runs a step's forwards.

A forward in which every request feeds the same number of rows (plain decode: 1; a DFlash draft
block or verify: B) replays a CUDA graph captured for the smallest batch size that holds it;
any other forward (prefill chunks mixed in) runs the same modules eagerly.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta, HostMeta, allocate_kv, device_meta
from batchrun.engine.cuda_graphs import GraphSet, StepBuffers, batch_ladder
from batchrun.models.dflash import DFlashDraft
from batchrun.models.qwen3 import Qwen3ForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        draft: DFlashDraft | None,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        s = model.shape
        self.model, self.draft, self.backend = model, draft, backend
        self.device, self.page_size, self.num_pages = device, page_size, num_pages
        dtype = model.lm_head.weight.dtype
        self.kv_caches = allocate_kv(
            s.num_layers, num_pages, page_size, s.num_kv_heads, s.head_dim, dtype, device
        )
        # The draft cache is indexed by the target's page tables: position i of a request
        # lives in the same slot of both.
        self.draft_kv = (
            allocate_kv(
                draft.shape.num_layers,
                num_pages,
                page_size,
                draft.shape.num_kv_heads,
                draft.shape.head_dim,
                dtype,
                device,
            )
            if draft is not None
            else []
        )
        self.capture_layers = draft.target_layer_ids if draft is not None else ()
        self.width = draft.block_size if draft is not None else 1
        self.buffers: StepBuffers | None = None
        self.target_graphs: GraphSet | None = None
        self.draft_graphs: GraphSet | None = None
        self.replays: Counter[tuple[str, int]] = Counter()  # (graph set, batch size) -> replays

    # -- CUDA graphs --------------------------------------------------------------------------

    def capture_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Capture the steady-state forwards for every ladder size up to max_batch_size (off a
        GPU: emulate them, for tests)."""
        max_pages = -(-(max_model_len + self.width) // self.page_size)
        self.buffers = StepBuffers(
            max_batch_size, self.width, max_pages, self.page_size, self.device
        )
        max_kv = max_model_len + self.width
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        sizes = batch_ladder(max_batch_size)
        self.target_graphs = GraphSet(
            "target", self._target_all_rows, self.buffers, self.backend, True, max_kv
        )
        self.target_graphs.capture(sizes, pool)
        if self.draft is not None:
            width = self.model.shape.hidden_size * len(self.capture_layers)
            self.buffers.ctx_features = torch.zeros(
                max_batch_size * self.width, width, dtype=self.model.lm_head.weight.dtype,
                device=self.device,
            )  # fmt: skip
            self.draft_graphs = GraphSet(
                "draft", self._draft_rows, self.buffers, self.backend, False, max_kv
            )
            self.draft_graphs.capture(sizes, pool)

    def _replayable(self, graphs: GraphSet | None, host: HostMeta) -> int | None:
        """The graph size to replay this forward at, or None to run it eagerly."""
        if graphs is None or len(host.kv_lens) == 0:
            return None
        if not (np.diff(host.cu_q) == self.width).all():
            return None
        return graphs.bucket(len(host.kv_lens))

    # -- target -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, host: HostMeta, logit_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the target over the step's rows (ids [T] on the device); returns float32 logits
        of `logit_rows` (every row when None) and the captured layer features of every row."""
        rows = len(host.positions)
        size = self._replayable(self.target_graphs, host)
        if size is not None and self.target_graphs is not None and self.buffers is not None:
            self.buffers.load(host, size)
            self.buffers.ids[:rows].copy_(ids)
            logits, *features = self.target_graphs.replay(size)
            self.replays["target", size] += 1
            logits = logits[:rows] if logit_rows is None else logits[logit_rows]
            return logits, features[0][:rows] if features else None
        meta = device_meta(host, self.page_size, self.device)
        self.backend.plan(meta)
        hidden, features = self.model(
            ids, meta.positions, self.backend, self.kv_caches, self.capture_layers
        )
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return self.model.logits(hidden), features

    def _target_all_rows(self, meta: AttentionMeta, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden, features = self.model(
            ids, meta.positions, self.backend, self.kv_caches, self.capture_layers
        )
        logits = self.model.logits(hidden)
        return (logits,) if features is None else (logits, features)

    # -- draft --------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft_forward(
        self,
        features: torch.Tensor,
        ctx_positions: np.ndarray,
        ctx_slots: np.ndarray,
        block_ids: torch.Tensor,
        host: HostMeta,
    ) -> torch.Tensor:
        """One draft forward: store the context K/V of newly committed tokens (features [C,
        layers * H] at ctx_positions / ctx_slots), then draft [R, B-1] for R requests whose
        blocks (anchor, then masks) are block_ids [R*B] at the positions and slots of `host`
        (non-causal over context plus block). Both parts replay from one graph when the
        context rows fit the graph (at most B per request, as in every steady-state step)."""
        assert self.draft is not None
        num_req = len(host.kv_lens)
        size = self._replayable(self.draft_graphs, host)
        if size is None or self.draft_graphs is None or self.buffers is None:
            self.write_draft_context(features, ctx_positions, ctx_slots)
            meta = device_meta(host, self.page_size, self.device, causal=False)
            self.backend.plan(meta)
            return self.draft.draft_block(
                self.model, block_ids, meta.positions, self.backend, self.draft_kv
            )
        ctx_rows = size * self.width
        if len(ctx_positions) > ctx_rows:  # after a prefill: more context than the graph holds
            self.write_draft_context(features, ctx_positions, ctx_slots)
            ctx_positions = ctx_slots = np.zeros(0, dtype=np.int64)
        self.buffers.load(host, size)
        self.buffers.load_context(features, ctx_positions, ctx_slots, ctx_rows)
        self.buffers.ids[: len(block_ids)].copy_(block_ids)
        self.replays["draft", size] += 1
        # A copy: graph outputs live in the pool that the target's graphs reuse.
        return self.draft_graphs.replay(size)[0][:num_req].clone()

    @torch.inference_mode()
    def write_draft_context(
        self, features: torch.Tensor, positions: np.ndarray, slots: np.ndarray
    ) -> None:
        """Store the draft's context K/V of newly committed tokens (eager: any number of rows)."""
        assert self.draft is not None
        if len(positions) == 0:
            return
        pos = torch.from_numpy(positions).to(self.device, non_blocking=True)
        slot = torch.from_numpy(slots).to(self.device, non_blocking=True)
        self.draft.write_context(features, pos, slot, self.backend, self.draft_kv)

    def _draft_rows(self, meta: AttentionMeta, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The captured draft forward: the padded context rows, then the blocks."""
        assert self.draft is not None and self.buffers is not None
        rows = ids.shape[0]
        assert self.buffers.ctx_features is not None
        self.draft.write_context(
            self.buffers.ctx_features[:rows], self.buffers.ctx_positions[1][:rows],
            self.buffers.ctx_slots[1][:rows], self.backend, self.draft_kv,
        )  # fmt: skip
        drafts = self.draft.draft_block(
            self.model, ids, meta.positions, self.backend, self.draft_kv
        )
        return (drafts,)
