"""How many KV pages fit: on a GPU, what the user's fraction of its memory leaves after the
weights (already loaded), the CUDA graphs' pool, the activations of the largest forward and a
draft's sliding-window rings (a fixed size); on a CPU, a fixed budget less the rings. A request
can never need more pages than a full context, so no more are made than every request of a
full batch could use."""

from __future__ import annotations

import torch

from batchrun.engine.config import EngineConfig
from batchrun.engine.cuda_graphs import graph_sizes
from batchrun.models.qwen3 import Qwen3Shape

CPU_KV_BUDGET_BYTES = 2 << 30


def layer_page_bytes(shape: Qwen3Shape, page_size: int, element: int) -> int:
    """One page of K and V in one layer of this shape."""
    return 2 * page_size * shape.num_kv_heads * shape.head_dim * element


def page_bytes(
    target: Qwen3Shape, draft: Qwen3Shape | None, page_size: int, element: int, draft_layers: int
) -> int:
    """One page of K and V in every target layer and the draft_layers that share the pages."""
    size = target.num_layers * layer_page_bytes(target, page_size, element)
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
) -> int:
    """draft_paged_layers: the draft layers whose K/V lives in the pages (full attention);
    ring_pages: each other (sliding) layer's ring, allocated apart; widths: the verify widths
    CUDA graphs are captured for."""
    bytes_per_page = page_bytes(target, draft, config.page_size, element, draft_paged_layers)
    rings = 0
    if draft is not None:
        sliding = draft.num_layers - draft_paged_layers
        rings = sliding * ring_pages * layer_page_bytes(draft, config.page_size, element)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        eager_rows = config.max_batched_tokens
        graph_rows = config.max_batch_size * width
        reserve = activation_bytes(
            target, eager_rows, config.max_batch_size, feature_layers, element
        )
        if config.cuda_graphs:  # the graphs' pool holds the largest graph's activations
            reserve += activation_bytes(target, graph_rows, graph_rows, feature_layers, element)
            reserve += graph_outputs_bytes(config, target, widths, feature_layers, element)
        in_use = torch.cuda.memory_reserved(device)  # the weights, loaded before this
        budget = int(total * config.gpu_memory_fraction) - in_use - reserve - rings
    else:
        budget = CPU_KV_BUDGET_BYTES - rings
    per_request = -(-(target.max_position_embeddings + width + 64) // config.page_size)
    want = config.max_batch_size * per_request
    return max(1, min(want, budget // bytes_per_page))


def graph_outputs_bytes(
    config: EngineConfig,
    target: Qwen3Shape,
    widths: tuple[int, ...],
    feature_layers: int,
    element: int,
) -> int:
    """What stays allocated for the graphs' replays: the logits buffer they share (float32, the
    largest graph's rows) and each graph's own captured features."""
    sizes = {w: graph_sizes(config.max_batch_size, w, config.max_batched_tokens) for w in widths}
    largest = max(max(s) * w for w, s in sizes.items())
    rows = sum(sum(s) * w for w, s in sizes.items())
    return largest * target.vocab_size * 4 + rows * feature_layers * target.hidden_size * element
