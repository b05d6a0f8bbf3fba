"""How many KV pages fit: on a GPU, what the user's fraction of its memory leaves after the
weights (already loaded), the CUDA graphs' pool, the activations of the largest forward and a
draft's sliding-window rings (a fixed size); on a CPU, a fixed budget less the rings. A request
can never need more pages than a full context, so no more are made than every request of a
full batch could use. A page counts the target's K/V at kv_cache_dtype's size (fp8: one byte an
element, so about twice the pages of bfloat16) and a draft's at the model dtype's.

Before any of that, `check_batch_memory` refuses batch limits that no device memory could run:
a lower bound of what a full step needs, from the models' shapes alone (preflight)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchrun.attention.kv_dtype import kv_element_size
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.page_pool import pages_for
from batchrun.engine.cuda_graphs import graph_rows, graph_sizes
from batchrun.engine.device_state import DEVICE_SLOT_BYTES
from batchrun.engine.linear_slots import linear_memory_bytes
from batchrun.engine.step_inputs import IN_FLIGHT_STEPS, step_in_size
from batchrun.errors import JobError
from batchrun.models.families import paged_layers
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.spec_decode.method import DraftLayout
from batchrun.spec_decode.verify_widths import verify_widths

CPU_KV_BUDGET_BYTES = 2 << 30


def layer_page_bytes(shape: Qwen3Shape, page_size: int, element: int) -> int:
    """One page of K and V in one layer of this shape."""
    return 2 * page_size * shape.num_kv_heads * shape.head_dim * element


def page_bytes(
    target: Qwen3Shape,
    draft: Qwen3Shape | None,
    page_size: int,
    element: int,
    draft_layers: int,
    kv_element: int | None = None,
) -> int:
    """One page of K and V in every target layer (kv_element bytes an element; None: element)
    and the draft_layers that share the pages (element bytes: a draft's K/V is never FP8)."""
    size = paged_layers(target) * layer_page_bytes(target, page_size, kv_element or element)
    if draft is not None:
        size += draft_layers * layer_page_bytes(draft, page_size, element)
    return size


def activation_bytes(
    s: Qwen3Shape, rows: int, logit_rows: int, feature_layers: int, element: int
) -> int:
    """A generous bound on the live activations of one forward of `rows` rows: a layer's
    intermediates (q/k/v, gate/up, the MLP product, residual streams), the captured features
    and float32 logits with the sampler's chunked temporaries."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_row = (q + 2 * kv) + q + 3 * s.intermediate_size + 4 * s.hidden_size
    per_row += feature_layers * s.hidden_size
    return rows * per_row * element + 2 * logit_rows * s.vocab_size * 4 + (64 << 20)


def kv_pages(
    config: EngineConfig,
    target: Qwen3Shape,
    draft: Qwen3Shape | None,
    feature_layers: int,
    element: int,
    width: int,
    device: torch.device,
    *,
    draft_paged_layers: int,
    ring_pages: int,
    widths: tuple[int, ...] = (1,),
    slot_bytes: int = 0,
    memory: tuple[int, int] | None = None,
) -> int:
    """draft_paged_layers: the draft layers whose K/V lives in the pages (full attention);
    ring_pages: each other (sliding) layer's ring, allocated apart; widths: the verify widths
    CUDA graphs are captured for; slot_bytes: per-request state allocated apart (a hybrid
    target's recurrent state slots and verify scratch). element: the model dtype's size (the
    target's K/V takes kv_cache_dtype's). memory: a GPU's total bytes and those in use (the
    weights), as a GPU would say them (default: the device's own)."""
    kv_element = kv_element_size(config.kv_cache_dtype, element)
    bytes_per_page = page_bytes(
        target, draft, config.page_size, element, draft_paged_layers, kv_element
    )
    rings = 0
    if draft is not None:
        sliding = draft.num_layers - draft_paged_layers
        rings = sliding * ring_pages * layer_page_bytes(draft, config.page_size, element)
    if device.type == "cuda" or memory is not None:
        if memory is None:  # the weights, loaded before this, are in use
            memory = torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)
        total, in_use = memory
        eager_rows = config.max_batched_tokens
        graph_rows = config.batch_size * width
        reserve = activation_bytes(target, eager_rows, config.batch_size, feature_layers, element)
        if config.cuda_graphs:  # the graphs' pool holds the largest graph's activations
            reserve += activation_bytes(target, graph_rows, graph_rows, feature_layers, element)
            reserve += graph_outputs_bytes(config, target, widths, feature_layers, element)
        budget = int(total * config.gpu_memory_fraction) - in_use - reserve - rings
    else:
        budget = CPU_KV_BUDGET_BYTES - rings
    budget -= slot_bytes
    per_request = -(-(target.max_position_embeddings + width + 64) // config.page_size)
    want = config.batch_size * per_request
    return max(1, min(want, budget // bytes_per_page))


def job_kv_pages(
    config: EngineConfig,
    target: Qwen3Shape,
    draft: DraftLayout | None,
    dtype: torch.dtype,
    device: torch.device,
    memory: tuple[int, int] | None = None,
) -> int:
    """kv_pages for a job's engine (dtype: the model's): with a draft (its method's layout,
    loaded or checked), its paged layers, its ring layers' rings (one per slot and the scratch
    slot), its block and the verify widths graphs are made for; a hybrid target's state slots
    and verify scratch (engine/linear_slots.py: what LinearSlots allocates). memory: as
    kv_pages's (preflight's: the weights' bytes in use, before they load)."""
    width = draft.block_size if draft is not None else 1
    rings = draft.ring_pages(config.page_size) if draft is not None else 0
    return kv_pages(
        config,
        target,
        draft.shape if draft is not None else None,
        draft.feature_layers if draft is not None else 0,
        dtype.itemsize,
        width,
        device,
        draft_paged_layers=draft.paged_layers if draft is not None else 0,
        ring_pages=rings * (config.batch_size + 1),
        widths=verify_widths(config.verify_width, draft),
        slot_bytes=linear_memory_bytes(target, dtype, config.batch_size, width),
        memory=memory,
    )


def context_limit(config: EngineConfig, target: Qwen3Shape) -> int:
    """The model's context, or max_model_len where that is shorter."""
    model_len = target.max_position_embeddings
    return min(config.max_model_len or model_len, model_len)


def usable_context(
    config: EngineConfig, target: Qwen3Shape, num_pages: int, width: int, device: torch.device
) -> int:
    """The longest context a request may reach: the model's (or max_model_len) within what the
    pool holds beside the rows in flight. JobError when that is under 2 tokens."""
    limit = context_limit(config, target)
    context = min(limit, num_pages * config.page_size - IN_FLIGHT_STEPS * width)
    if context < 2:
        fraction = f" in gpu_memory_fraction {config.gpu_memory_fraction}"
        raise JobError(
            f"the KV pool ({num_pages} pages of {config.page_size}) is too small: what "
            f"max_batch_size {config.max_batch_size} and max_batched_tokens "
            f"{config.max_batched_tokens} need leaves no room for it"
            + (fraction if device.type == "cuda" else "")
        )
    return context


def graph_outputs_bytes(
    config: EngineConfig,
    target: Qwen3Shape,
    widths: tuple[int, ...],
    feature_layers: int,
    element: int,
) -> int:
    """What stays allocated for the graphs' replays: the logits buffer they share (float32, the
    largest graph's rows) and each graph's own captured features."""
    batch, tokens = config.batch_size, config.max_batched_tokens
    largest = graph_rows(batch, widths, tokens)
    rows = sum(sum(graph_sizes(batch, w, tokens)) * w for w in widths)
    return largest * target.vocab_size * 4 + rows * feature_layers * target.hidden_size * element


# -- batch limits against the device's memory, before any weights load -------------------------

# A slot of the per-request device state beside its page-table row (int32 per page): the
# DeviceState's fields with the sampling tables, and a drafting speculator's per-slot context
# (two int64: where its context ends), counted for every job.
PER_SLOT_BYTES = DEVICE_SLOT_BYTES + 2 * 8


def device_memory_bytes(device: torch.device) -> int:
    """All the memory of the device: a GPU's total (not what is free now), else the host's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class BatchFootprint:
    """A lower bound of the memory one engine (one tensor-parallel rank's) needs to run the steps
    its batch limits allow, from shapes alone: its weights, the buffers it allocates per request
    slot and per batched token (DeviceState, the packed step inputs, drafts, a sliding draft's
    rings), and what a full step holds: a full batch of max_batch_size requests, each with at
    least one page of K/V and its rows of float32 logits (at the narrowest verify width), and a
    forward of max_batched_tokens rows, which holds at least the residual stream and the
    widest projection's output of every row. Each term is the least the engine could get by
    with (a context of 2 tokens, one page per request), so a job it refuses cannot run."""

    target: Qwen3Shape
    draft: Qwen3Shape | None
    weight_bytes: int  # this rank's weights (the target's share, the whole draft)
    element: int  # bytes per weight and activation element
    width: int = 1  # the draft's block size, else 1
    min_width: int = 1  # the narrowest verify width: rows of logits per decoding request
    page_size: int = 16
    draft_paged_layers: int = 0  # draft layers whose K/V lives in the target's pages
    ring_pages: int = 0  # pages of every sliding draft layer's ring, per slot
    tp: int = 1
    kv_element: int | None = None  # bytes per element of the target's K/V (None: element)

    def bytes(self, max_batch_size: int, max_batched_tokens: int) -> int:
        s, tp, el = self.target, self.tp, self.element
        slots, tokens = max_batch_size, max_batched_tokens
        # The engine refuses a context below 2 tokens: every page table holds this many pages.
        max_pages = pages_for(2 + IN_FLIGHT_STEPS * self.width, self.page_size)
        buffers = (slots + 1) * (4 * max_pages + PER_SLOT_BYTES)
        buffers += 8 * step_in_size(slots, tokens, max_pages)
        buffers += 8 * slots * max(self.width - 1, 1)  # the drafted tokens
        if self.draft is not None and self.ring_pages:
            ring = self.ring_pages * layer_page_bytes(self.draft, self.page_size, el)
            buffers += (slots + 1) * (ring + 4 * max_pages)  # and the ring's page table
        local = dataclasses.replace(s, num_kv_heads=max(s.num_kv_heads // tp, 1))
        paged = self.draft_paged_layers
        kv = slots * page_bytes(local, self.draft, self.page_size, el, paged, self.kv_element)
        logits = min(slots * self.min_width, tokens) * -(-s.vocab_size // tp) * 4
        q, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        widest = max(q + 2 * kv_dim, 2 * s.intermediate_size) // tp
        forward = tokens * (s.hidden_size + widest) * el
        return self.weight_bytes + buffers + kv + logits + forward


def check_batch_memory(
    footprint: BatchFootprint,
    max_batch_size: int,
    max_batched_tokens: int,
    device: torch.device,
    available: int | None = None,
) -> None:
    """Refuses batch limits whose footprint (a lower bound) exceeds the device's memory
    (`available`, default all of it), naming the flag and the largest value of it that fits.
    The token budget is at least the draft's block size (check_batch_budget)."""
    available = device_memory_bytes(device) if available is None else available
    need = footprint.bytes(max_batch_size, max_batched_tokens)
    if need <= available:
        return
    where = f"the memory of {device} ({_size(available)})"
    least = footprint.width
    smallest = footprint.bytes(1, least)
    if smallest > available:
        raise JobError(
            f"the models do not fit in {where}: their weights and a batch of one request need "
            f"at least {_size(smallest)}"
        )
    batch_part = footprint.bytes(max_batch_size, least) - smallest
    token_part = footprint.bytes(1, max_batched_tokens) - smallest
    if token_part > batch_part:
        key, value, other, other_value, other_least = (
            "max_batched_tokens",
            max_batched_tokens,
            "max_batch_size",
            max_batch_size,
            1,
        )

        def fits(n: int, o: int) -> bool:
            return footprint.bytes(o, n) <= available
    else:
        key, value, other, other_value, other_least = (
            "max_batch_size",
            max_batch_size,
            "max_batched_tokens",
            max_batched_tokens,
            least,
        )

        def fits(n: int, o: int) -> bool:
            return footprint.bytes(n, o) <= available

    low = 1 if key == "max_batch_size" else least
    if not fits(low, other_value):
        other_value = other_least  # the other flag leaves no room: with its least
    largest = _largest(lambda n: fits(n, other_value), low, value)
    raise JobError(
        f"{key} {value} does not fit in {where}: the batch needs at least {_size(need)} "
        f"(weights, per-request buffers, K/V and logits of a full batch, activations of a full "
        f"forward); {key} {largest} fits at most, with {other} {other_value}"
    )


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high) with fits(n), given fits(low) and fits monotone."""
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
