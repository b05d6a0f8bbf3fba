"""An engine's start-up, stage by stage: load the models, choose the batch (unless given), size
the KV pool from memory, choose the attention backend (the runner and graphs follow in the
engine). Under tensor parallelism every rank runs these in lockstep, and what memory or timings
decide is agreed across ranks: the least batch and pool, rank 0's backend. Each stage's seconds
go to stats.json (`startup_seconds`) and `batchrun bench --jobs`: a job's start-up is part of
what its user waits for."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from batchrun.attention.base import AttentionBackend
from batchrun.attention.choice import MEASURED_CONTEXT, Workload
from batchrun.engine.attention_backends import attention_backend
from batchrun.engine.batch_choice import BatchChoice, RowTokens, job_batch
from batchrun.engine.config import EngineConfig
from batchrun.engine.memory import context_limit, job_kv_pages, usable_context
from batchrun.layers.ops import use_ops
from batchrun.models.families import paged_layers
from batchrun.models.loader import load_qwen3
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.models.tokenizer import eos_token_ids, load_tokenizer
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.method import DraftLayout
from batchrun.spec_decode.registry import draft_layout, load_draft

ROPE_HEADROOM = 1024  # verify/draft rows may run past the context end; their tokens are cut


class StartupClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}  # stage -> seconds, in the order they ran
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        """`stage` ends now (on a GPU: once the work it queued has run)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 3)
        self._last = now


@dataclass(frozen=True)
class Models:
    """What an engine runs: the target (this rank's share under tensor parallelism), the draft
    (its speculation method's model) and the target's tokenizer and end-of-sequence ids."""

    target: Qwen3ForCausalLM
    draft: nn.Module | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    eos: frozenset[int] = frozenset()

    @property
    def draft_layout(self) -> DraftLayout | None:
        return draft_layout(self.draft)


def load_models(
    config: EngineConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    device: torch.device,
    tp: TensorParallel | None,
    clock: StartupClock,
) -> Models:
    """The checkpoints of `config` on `device` (and the tokenizer, unless it is given)."""
    target_dir = Path(config.target)
    model, model_config = load_qwen3(target_dir, config.dtype, device, ROPE_HEADROOM, tp)
    clock.lap("load_target")
    draft = None
    if config.draft:
        max_positions = model.shape.max_position_embeddings + ROPE_HEADROOM
        method = config.speculative_method
        draft = load_draft(Path(config.draft), method, model, device, max_positions)
        clock.lap("load_draft")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_dir)
    eos = eos_token_ids(target_dir, model_config, tokenizer)
    clock.lap("load_tokenizer")
    return Models(model, draft, tokenizer, frozenset(eos))


def choose_engine_batch(
    config: EngineConfig,
    models: Models,
    rows: RowTokens | None,
    tp: TensorParallel | None,
    chosen: BatchChoice | None = None,
) -> BatchChoice:
    """The batch the engine runs: `chosen` (the runner's, from preflight) or the given
    max_batch_size, else the rule's from the memory left beside the loaded weights and the
    device's rates measured now; rows: the job's (None: the model's max positions). Under
    tensor parallelism a chosen batch is the least over ranks."""
    if chosen is None:
        target = models.target
        device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
        loaded = [m for m in (target, models.draft) if m is not None]
        weights = sum(p.numel() * p.element_size() for m in loaded for p in m.parameters())
        rows = rows or RowTokens.unknown(context_limit(config, target.shape))
        layout = models.draft_layout
        chosen = job_batch(config, target.shape, layout, dtype, device, weights, rows)
    if tp is not None and chosen.chosen:
        chosen = replace(chosen, size=tp.minimum(chosen.size))
    return chosen


def size_memory(
    config: EngineConfig,
    models: Models,
    block: int,
    tp: TensorParallel | None,
    num_pages: int | None = None,
) -> tuple[int, int]:
    """The KV pool's pages (given, configured, or what memory holds at the target's KV dtype,
    kv_cache_dtype's; the least over ranks) and the context they leave a request."""
    target = models.target
    device = target.lm_head.weight.device
    dtype = target.lm_head.weight.dtype
    num_pages = num_pages or config.num_pages
    layout = models.draft_layout
    num_pages = num_pages or job_kv_pages(config, target.shape, layout, dtype, device)
    if tp is not None:
        num_pages = tp.minimum(num_pages)
    return num_pages, usable_context(config, target.shape, num_pages, block, device)


@dataclass(frozen=True)
class BackendChoice:
    backend: AttentionBackend
    # A second backend of the kind for a draft's sliding-window layers: they plan their own
    # metadata (None: no such layers).
    window_backend: AttentionBackend | None
    measured_ms: dict[str, float] | None  # `auto`'s timings of its candidates


def choose_backend(
    config: EngineConfig,
    models: Models,
    block: int,
    max_model_len: int,
    tp: TensorParallel | None,
) -> BackendChoice:
    """The attention backend for this workload (`auto` times its candidates on each rank:
    rank 0's wins), and the models' small ops bound to its kind."""
    target, draft = models.target, models.draft_layout
    shape, device = target.shape, target.lm_head.weight.device
    workload = Workload(
        num_heads=max(shape.num_heads, draft.shape.num_heads if draft else 0),
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=str(target.lm_head.weight.dtype).removeprefix("torch."),
        page_size=config.page_size,
        batch=config.batch_size,
        block_size=block,
        num_layers=paged_layers(shape),
        draft_layers=draft.paged_layers + draft.ring_layers if draft else 0,
        context=min(MEASURED_CONTEXT, max_model_len - block),
    )
    kv = config.kv_cache_dtype
    backend, ops, measured = attention_backend(config.attention_backend, device, workload, kv)
    chosen = tp.of_first(backend.name) if tp is not None else backend.name
    if chosen != backend.name:
        backend, ops, _ = attention_backend(chosen, device, workload, kv)
    window_backend = None
    if draft is not None and draft.window:
        window_backend = attention_backend(backend.name, device, workload, kv)[0]
    for model in (target, models.draft):
        if model is not None:
            use_ops(model, ops)
    return BackendChoice(backend, window_backend, measured)
