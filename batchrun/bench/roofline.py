"""What one step must at least move and compute. A hybrid target's step moves
the KV of its full-attention layers only (a quarter of Qwen3.5's) and its requests' linear
state: read and written by a decode step, read once more by a verify step's commit."""

from __future__ import annotations

import torch

from batchrun.engine.device_rates import Ceilings
from batchrun.models.families import paged_layers
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.models.qwen3_5 import (
    LINEAR,
    Qwen3_5Shape,
    linear_state_bytes,
    linear_verify_row_bytes,
)

# The model dtype of an element size: the linear state's conv part is kept in it.
_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def weight_bytes(
    shape: Qwen3Shape, element: int, layers: int | None = None, experts: float | None = None
) -> int:
    """Bytes of the weights one forward reads (the embedding: only its rows, so not counted).
    A MoE layer reads its router and `experts` of its experts (None: all of them). The
    projections an FP8 checkpoint keeps in FP8 (experts included) take a byte an element
    (their scales: not counted, 1/16,384 of them)."""
    s = shape
    projection = 1 if s.fp8_block is not None else element
    total = 0.0
    for i in range(layers or s.num_layers):
        total += _mixer_bytes(s, i, projection, element)
        if s.sparse(i):
            read = s.num_experts if experts is None else experts
            router = s.hidden_size * s.num_experts * element
            total += router + read * 3 * s.hidden_size * s.moe_intermediate_size * projection
        else:
            total += 3 * s.hidden_size * s.intermediate_size * projection
    return int(total + element * s.vocab_size * s.hidden_size)


def _mixer_bytes(s: Qwen3Shape, layer: int, projection: int, element: int) -> int:
    """The token mixer's weights in layer `layer`: Qwen3's attention; a hybrid's gated
    attention (its query projection twice as wide: the gate) or Gated DeltaNet (in_proj, the
    conv and out_proj, kept in the model dtype by an FP8 checkpoint too)."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    if not isinstance(s, Qwen3_5Shape):
        return (s.hidden_size * (q + 2 * kv) + q * s.hidden_size) * projection
    if s.layer_types[layer] != LINEAR:
        return (s.hidden_size * (2 * q + 2 * kv) + q * s.hidden_size) * projection
    heads, value = s.linear_num_value_heads, s.linear_num_value_heads * s.linear_value_head_dim
    in_proj = s.hidden_size * (s.conv_dim + value + 2 * heads)
    return (in_proj + s.conv_dim * s.linear_conv_kernel + value * s.hidden_size) * element


def state_bytes(shape: Qwen3Shape, element: int, verify_rows: int = 0) -> int:
    """The linear state one request's step moves (0 without linear layers): a decode or verify
    step reads it and writes it once (the rows its last verify kept taken first); a verify of
    verify_rows rows also writes what each row keeps for the commit, read once later."""
    if not isinstance(shape, Qwen3_5Shape):
        return 0
    dtype = _DTYPES[element]
    rows = 2 * verify_rows * linear_verify_row_bytes(shape, dtype)
    return 2 * linear_state_bytes(shape, dtype) + rows


def _recurrent_flops(shape: Qwen3Shape) -> int:
    """A token's Gated DeltaNet updates over all linear layers: per value head, three products
    of the dk x dv state (S^T k, the rank-one update, S^T q) of 2 FLOPs an element."""
    if not isinstance(shape, Qwen3_5Shape):
        return 0
    per_head = 6 * shape.linear_key_head_dim * shape.linear_value_head_dim
    return len(shape.linear_layers) * shape.linear_num_value_heads * per_head


def experts_read(shape: Qwen3Shape, tokens: int) -> float:
    """The distinct experts `tokens` tokens route to, expected under uniform routing:
    E (1 - (1 - k/E)^tokens)."""
    e, k = shape.num_experts, shape.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens) if e else 0.0


def step_floor_ms(
    shape: Qwen3Shape,
    element: int,
    batch: int,
    context: int,
    rows_per_request: int,
    ceilings: Ceilings,
    kv_element: int | None = None,
) -> dict[str, float]:
    """The least time a target step can take: the weights it reads (a MoE layer: the experts
    its tokens route to), the batch's KV of its paged layers read once (kv_element bytes an
    element; None: element) and its linear state moved (state_bytes), or its matmuls at the
    measured rate, whichever is longer."""
    s = shape
    tokens = batch * rows_per_request
    kv_bytes = batch * context * paged_layers(s) * 2 * s.num_kv_heads * s.head_dim
    kv_bytes *= kv_element or element
    verify = rows_per_request if rows_per_request > 1 else 0
    kv_bytes += batch * state_bytes(s, element, verify)
    moved = weight_bytes(s, element, experts=experts_read(s, tokens)) + kv_bytes
    # Each token's matmuls: its own top-k experts (a dense model's whole MLP).
    flops = 2 * weight_bytes(s, 1, experts=s.num_experts_per_tok) * tokens
    memory_ms = moved / ceilings.copy_bytes_per_s * 1e3
    compute_ms = flops / ceilings.matmul_rate(s) * 1e3
    return {
        "memory_ms": memory_ms,
        "compute_ms": compute_ms,
        "floor_ms": max(memory_ms, compute_ms),
    }


def job_bound(
    shape: Qwen3Shape,
    element: int,
    prompt_lens: list[int],
    max_tokens: list[int],
    batch: int,
    ceilings: Ceilings,
    kv_element: int | None = None,
) -> dict[str, float]:
    """The least time a whole job can take on this device without speculation: every token's
    matmuls and attention at the measured matmul rate, or the weights read once per decode step
    (at least the longest row's outputs, and every output spread over full batches) plus each
    output token's K/V context read (kv_element bytes an element; None: element), at the
    measured copy rate, whichever is longer; FP8 weights at the FP8 matmul rate. A MoE
    token multiplies by its top-k experts; a decode step reads the experts a full batch routes
    to. A hybrid's attention and K/V are its full-attention layers'; each output token also
    reads and writes its request's linear state, and costs its Gated DeltaNet updates. Also
    the bound of the phases run one after the other (serial_bound_seconds)."""
    s = shape
    per_token = s.num_experts_per_tok or None  # experts one token's matmuls use (None: dense)
    layer_params = weight_bytes(s, 1, experts=per_token) - s.vocab_size * s.hidden_size
    paged = paged_layers(s)
    kv_per_token = paged * 2 * s.num_kv_heads * s.head_dim * (kv_element or element)
    attention = 4 * paged * s.num_heads * s.head_dim  # FLOPs per (query, key) pair
    per_output = state_bytes(s, element)
    flops = prompt_flops = context_read = 0.0
    for prompt, out in zip(prompt_lens, max_tokens, strict=True):
        per_position = 2 * layer_params + _recurrent_flops(s)
        prompt_flops += per_position * prompt + attention * prompt * (prompt - 1) / 2
        flops += per_position * (prompt + out) + 2 * s.vocab_size * s.hidden_size * out
        context = (prompt + out) * (prompt + out - 1) / 2  # keys each position attends to
        flops += attention * context
        context_read += kv_per_token * (prompt * out + out * (out - 1) / 2) + per_output * out
    steps = max(max(max_tokens, default=0), -(-sum(max_tokens) // batch))
    moved = steps * weight_bytes(s, element, experts=experts_read(s, batch) or None) + context_read
    compute_s = flops / ceilings.matmul_rate(s)
    memory_s = moved / ceilings.copy_bytes_per_s
    prefill_s = prompt_flops / ceilings.matmul_rate(s)
    decode_s = max(compute_s - prefill_s, memory_s)
    return {
        "compute_seconds": compute_s,
        "memory_seconds": memory_s,
        "bound_seconds": max(compute_s, memory_s),
        # The phases one after the other: the prompts' matmuls, then decoding at the larger of
        # its matmuls and its reads. The bound above assumes the two overlap, which a schedule
        # whose waves prefill together and then decode together does not do.
        "serial_bound_seconds": prefill_s + decode_s,
        "flops": flops,
        "bytes": moved,
    }
