"""Runs the DFlash draft for a scheduled batch: one forward writes every request's new context
K/V into the draft cache and drafts a full block for every request that is about to verify."""

from __future__ import annotations

import dataclasses

import torch

from batchrun.engine.model_runner import StepInput, allocate_kv, build_meta, device_tensor
from batchrun.engine.page_pool import slot_ids
from batchrun.engine.scheduler import Scheduled
from batchrun.layers.attention import AttentionBackend
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
        features: list[torch.Tensor] = []
        ctx_pos: list[int] = []
        ctx_slots: list[int] = []
        for it in batch:
            req = it.req
            if not req.pending_features:
                continue
            rows = torch.cat(req.pending_features)
            features.append(rows)
            ctx_pos.extend(range(req.draft_cached, req.draft_cached + rows.shape[0]))
            ctx_slots += slot_ids(req.pages, req.draft_cached, rows.shape[0], self.page_size)
            req.draft_cached += rows.shape[0]
            req.pending_features.clear()
        drafting = [it.req for it in batch if it.decoding]
        if not features and not drafting:
            return {}
        for req in drafting:
            assert req.draft_cached == req.num_cached, "draft context must end at the anchor"
        mask = self.draft.mask_token_id
        block = StepInput(
            token_ids=[[r.output_ids[-1]] + [mask] * (self.block_size - 1) for r in drafting],
            start=[r.num_cached for r in drafting],
            page_tables=[r.pages for r in drafting],
        )
        block_ids, meta = build_meta(block, self.page_size, self.device, causal=False)
        # The context rows' K/V are written first, then the block's (the draft's row order).
        slots = device_tensor(ctx_slots, torch.long, self.device)
        meta = dataclasses.replace(meta, slot_mapping=torch.cat((slots, meta.slot_mapping)))
        backend: AttentionBackend = self.backend_factory()
        backend.plan(meta)
        width = self.target.shape.hidden_size * len(self.draft.target_layer_ids)
        feats = torch.cat(features) if features else torch.zeros(0, width, device=self.device)
        drafts = self.draft(
            self.target,
            block_ids,
            meta.positions,
            feats,
            device_tensor(ctx_pos, torch.long, self.device),
            backend,
            self.kv_caches,
        )
        return {id(r): d for r, d in zip(drafting, drafts.tolist(), strict=True)}
