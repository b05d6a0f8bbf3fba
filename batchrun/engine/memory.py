"""How many KV pages fit: on a GPU, what the user's fraction of its memory leaves after the
weights (already loaded), the CUDA graphs' pool and the activations of the largest forward; on
a CPU, a fixed budget. A request can never need more pages than a full context, so no more are
made than every request of a full batch could use."""

from __future__ import annotations

import torch

from batchrun.engine.config import EngineConfig
from batchrun.models.qwen3 import Qwen3Shape

CPU_KV_BUDGET_BYTES = 2 << 30


def page_bytes(target: Qwen3Shape, draft: Qwen3Shape | None, page_size: int, element: int) -> int:
    """One page of K and V in every target and draft layer."""
    layers = target.num_layers * target.num_kv_heads * target.head_dim
    if draft is not None:
        layers += draft.num_layers * draft.num_kv_heads * draft.head_dim
    return 2 * page_size * layers * element


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
) -> int:
    bytes_per_page = page_bytes(target, draft, config.page_size, element)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        eager_rows = config.max_batched_tokens
        graph_rows = config.max_batch_size * width
        reserve = activation_bytes(
            target, eager_rows, config.max_batch_size, feature_layers, element
        )
        if config.cuda_graphs:  # the graphs' pool holds the largest graph's activations
            reserve += activation_bytes(target, graph_rows, graph_rows, feature_layers, element)
        in_use = torch.cuda.memory_reserved(device)  # the weights, loaded before this
        budget = int(total * config.gpu_memory_fraction) - in_use - reserve
    else:
        budget = CPU_KV_BUDGET_BYTES
    per_request = -(-(target.max_position_embeddings + width + 64) // config.page_size)
    want = config.max_batch_size * per_request
    return max(1, min(want, budget // bytes_per_page))
