"""Turns a scheduled batch into one batched target forward over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.page_pool import slot_ids
from batchrun.layers.attention import AttentionBackend
from batchrun.layers.attention_meta import AttentionMeta
from batchrun.models.qwen3 import Qwen3ForCausalLM


@dataclass
class StepInput:
    """One forward's rows, built on the host: request r feeds token_ids[r] at positions
    start[r] .. start[r] + len(token_ids[r]) - 1."""

    token_ids: list[list[int]]
    start: list[int]
    page_tables: list[list[int]]


def allocate_kv(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def device_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor built on the host from Python values, then copied to the device."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


def build_meta(
    step: StepInput, page_size: int, device: torch.device, causal: bool = True
) -> tuple[torch.Tensor, AttentionMeta]:
    """Flat input ids and the attention metadata of a step, as device tensors. A step may be
    empty (a DFlash draft forward that only writes context rows)."""
    q_lens = [len(t) for t in step.token_ids]
    kv_lens = [s + n for s, n in zip(step.start, q_lens, strict=True)]
    positions = [p for s, n in zip(step.start, q_lens, strict=True) for p in range(s, s + n)]
    slots = [
        slot
        for table, s, n in zip(step.page_tables, step.start, q_lens, strict=True)
        for slot in slot_ids(table, s, n, page_size)
    ]
    width = max((len(t) for t in step.page_tables), default=0)
    table = [t + [0] * (width - len(t)) for t in step.page_tables]
    cu_q = [0]
    for n in q_lens:
        cu_q.append(cu_q[-1] + n)
    meta = AttentionMeta(
        positions=device_tensor(positions, torch.long, device),
        slot_mapping=device_tensor(slots, torch.long, device),
        cu_q=device_tensor(cu_q, torch.int32, device),
        kv_lens=device_tensor(kv_lens, torch.int32, device),
        page_table=device_tensor(table, torch.int32, device).view(len(table), width),
        page_size=page_size,
        max_q=max(q_lens, default=0),
        max_kv=max(kv_lens, default=0),
        causal=causal,
    )
    input_ids = device_tensor([t for ids in step.token_ids for t in ids], torch.long, device)
    return input_ids, meta


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        backend_factory: type,
        num_pages: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        s = model.shape
        self.model, self.device, self.page_size = model, device, page_size
        self.backend_factory = backend_factory
        dtype = model.lm_head.weight.dtype
        self.kv_caches = allocate_kv(
            s.num_layers, num_pages, page_size, s.num_kv_heads, s.head_dim, dtype, device
        )

    @torch.inference_mode()
    def forward(
        self, step: StepInput, logit_rows: list[int], capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the target over the step's rows; returns float32 logits of `logit_rows` (flat
        row indices) and the captured layer features of every row (or None)."""
        input_ids, meta = build_meta(step, self.page_size, self.device)
        backend: AttentionBackend = self.backend_factory()
        backend.plan(meta)
        hidden, features = self.model(
            input_ids, meta.positions, backend, self.kv_caches, capture_layers
        )
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden[rows]), features
