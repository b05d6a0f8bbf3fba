"""Runs the DFlash draft for a scheduled batch: one forward writes every request's new context
K/V into the draft cache and drafts a full block for every request that is about to verify."""

from __future__ import annotations

import torch

from batchrun.engine.model_runner import allocate_kv
from batchrun.engine.page_pool import slot_ids
from batchrun.engine.scheduler import Scheduled
from batchrun.layers.attention import AttentionBackend
from batchrun.layers.attention_meta import AttentionMeta
from batchrun.models.dflash import DFlashDraft
from batchrun.models.qwen3 import Qwen3ForCausalLM


class Drafter:
    def __init__(
        self,
        draft: DFlashDraft,
        target: Qwen3ForCausalLM,
        backend_factory: type,
        num_pages: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        s = draft.shape
        self.draft, self.target, self.device = draft, target, device
        self.backend_factory, self.page_size = backend_factory, page_size
        self.block_size = draft.block_size
        # Indexed by the target's page tables: position i of a request lives in the same slot.
        self.kv_caches = allocate_kv(
            s.num_layers, num_pages, page_size, s.num_kv_heads, s.head_dim,
            target.lm_head.weight.dtype, device,
        )  # fmt: skip

    @torch.inference_mode()
    def propose(self, batch: list[Scheduled]) -> dict[int, list[int]]:
        """Drafts d1 .. d_{B-1} per decoding request (keyed by id()); consumes pending features."""
        b, ps = self.block_size, self.page_size
        features: list[torch.Tensor] = []
        ctx_pos: list[int] = []
        ctx_slots: list[int] = []
        drafting = [it.req for it in batch if it.decoding]
        for it in batch:
            req = it.req
            if not req.pending_features:
                continue
            rows = torch.cat(req.pending_features)
            features.append(rows)
            ctx_pos.extend(range(req.draft_cached, req.draft_cached + rows.shape[0]))
            ctx_slots += slot_ids(req.pages, req.draft_cached, rows.shape[0], ps)
            req.draft_cached += rows.shape[0]
            req.pending_features.clear()
        if not features and not drafting:
            return {}
        for req in drafting:
            assert req.draft_cached == req.num_cached, "draft context must end at the anchor"
        block_pos = [p for r in drafting for p in range(r.num_cached, r.num_cached + b)]
        block_slots = [s for r in drafting for s in slot_ids(r.pages, r.num_cached, b, ps)]
        width = max((len(r.pages) for r in drafting), default=0)
        dev = self.device

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(dev, non_blocking=True)

        meta = AttentionMeta(
            positions=tensor(block_pos, torch.long),
            slot_mapping=tensor(ctx_slots + block_slots, torch.long),
            cu_q=tensor([i * b for i in range(len(drafting) + 1)], torch.int32),
            kv_lens=tensor([r.num_cached + b for r in drafting], torch.int32),
            page_table=tensor(
                [r.pages + [0] * (width - len(r.pages)) for r in drafting], torch.int32
            ).view(len(drafting), width),
            page_size=ps,
            max_q=b,
            max_kv=max((r.num_cached + b for r in drafting), default=0),
            causal=False,
        )
        backend: AttentionBackend = self.backend_factory()
        backend.plan(meta)
        hidden = self.target.shape.hidden_size * len(self.draft.target_layer_ids)
        feats = torch.cat(features) if features else torch.zeros(0, hidden, device=dev)
        drafts = self.draft(
            self.target,
            tensor([r.output_ids[-1] for r in drafting], torch.long),
            meta.positions,
            feats,
            tensor(ctx_pos, torch.long),
            backend,
            self.kv_caches,
        )
        return {id(r): d for r, d in zip(drafting, drafts.tolist(), strict=True)}
