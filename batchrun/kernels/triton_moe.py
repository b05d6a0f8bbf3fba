"""Fused experts of a MoE layer: each token's top-k (token, expert) pairs sorted by expert into
blocks of BLOCK_M rows, then one grouped GEMM launch per projection, every block multiplying its
rows by its own expert's weights (as the well-known fused-MoE kernels do).

`align` sorts on the device with torch ops and no host synchronisation, into buffers sized from
the tensor shapes alone (the worst case: every expert's last block partly empty), so a step with
experts can be captured in a CUDA graph. `fused_experts` is the layer's whole expert path: gate
and up projections, SiLU-and-mul, the down projection weighted by the router's probability, and
the sum over each token's k experts. Matches layers/moe.py's reference up to summation order.

FP8 experts (an FP8 checkpoint's, one float32 scale per block of each expert's weight) multiply
fp8 tiles on the tensor cores: each projection's input is quantized per row and block of columns
first (kernels/triton_fp8.py's quantize_groups), and each k step's dot is scaled by its row's and
its weight block's scales, as the dense FP8 matmul does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from batchrun.kernels.triton_attention import interpreting
from batchrun.kernels.triton_fp8 import quantize_groups

# An FP8 MoE layer's expert scales and their block: (w13's, w2's, (block rows, block columns)).
Fp8Experts = tuple[torch.Tensor, torch.Tensor, tuple[int, int]]


@triton.jit
def _expert_matmul_kernel(
    a_ptr,  # [rows, K]: row r feeds the pairs r * A_PER_ROW .. (r + 1) * A_PER_ROW - 1
    b_ptr,  # [E, N, K]: each expert's weight, as nn.Linear stores it
    c_ptr,  # [pairs, N]
    sorted_ptr,  # [padded] pair ids sorted by expert; `num_pairs` marks padding
    block_expert_ptr,  # [padded / BLOCK_M] the expert of each block
    total_ptr,  # [1] the padded rows in use
    weight_ptr,  # [pairs] the router's probabilities (MUL_WEIGHT)
    a_scale_ptr,  # FP8: [K / BLOCK_K, rows] a's scale per row and block of BLOCK_K columns
    b_scale_ptr,  # FP8: [E, N / scale_n, K / BLOCK_K] b's scale per block
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_as,
    stride_bse,
    stride_bsn,
    scale_n,
    A_PER_ROW: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP8: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // A_PER_ROW).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_scales = b_scale_ptr + expert * stride_bse + (cols // scale_n) * stride_bsn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + depth
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
            mask=(cols < N)[None, :] & (ks < K)[:, None],
            other=0.0,
        )
        if FP32_DOT:  # float32 weights (no TF32), or the interpreter (its bf16 dot is wrong)
            dot = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            dot = tl.dot(a, b)
        if FP8:  # BLOCK_K is the scales' block of columns
            a_scale = tl.load(a_scale_ptr + (k0 // BLOCK_K) * stride_as + a_rows, mask=valid)
            b_scale = tl.load(b_scales + k0 // BLOCK_K, mask=cols < N)
            acc += dot * a_scale[:, None] * b_scale[None, :]
        else:
            acc += dot
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols < N)[None, :])


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when few pairs fall to each expert (decode), else larger tiles."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [pairs] (each pair's expert) -> (pair ids sorted by expert, each expert's run
    padded to whole blocks with `pairs` as padding; each block's expert; the padded rows in
    use [1]), all on the device, sized from the shapes alone."""
    pairs = experts.numel()
    device = experts.device
    padded_size = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    # A counting sort: a pair's rank among its expert's pairs from a running count per expert
    # (a device argsort costs more launches). The count runs along the last dimension: torch
    # scans an outer one column by column, one element after another, a cost that shows in
    # every MoE layer (docs/benchmarks.md, Kernel tuning).
    chosen = torch.arange(num_experts, device=device)[:, None] == experts
    running = chosen.cumsum(1)  # [experts, pairs] (a one_hot could check its input on the host)
    counts = running[:, -1]
    rank = running.gather(0, experts[None, :]).squeeze(0) - 1
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_ids = torch.full((padded_size,), pairs, dtype=torch.int64, device=device)
    sorted_ids[ends[experts] - padded[experts] + rank] = torch.arange(pairs, device=device)
    block_starts = torch.arange(0, padded_size, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert, ends[-1:]


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    experts: torch.Tensor,  # [T, k]
    weights: torch.Tensor,  # [T, k] the router's probabilities, in x's dtype
    silu_mul: Callable[[torch.Tensor], torch.Tensor],
    fp8: Fp8Experts | None = None,  # FP8 experts: their scales and block
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j]."""
    tokens, k = experts.shape
    num_experts, hidden = w13.shape[0], x.shape[1]
    block_m = block_rows(tokens * k, num_experts)
    sorted_ids, block_expert, total = align(experts.reshape(-1), num_experts, block_m)
    routing = (sorted_ids, block_expert, total, block_m)
    w13_scale, w2_scale, block = fp8 if fp8 is not None else (None, None, None)
    gate_up = x.new_empty(tokens * k, w13.shape[1])
    _matmul(x, w13, w13_scale, block, gate_up, routing, k, None)
    down = x.new_empty(tokens * k, hidden)
    flat = weights.reshape(-1)
    _matmul(silu_mul(gate_up), w2, w2_scale, block, down, routing, 1, flat)
    return down.view(tokens, k, hidden).sum(dim=1)


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    c: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    a_per_row: int,
    weights: torch.Tensor | None,
) -> None:
    sorted_ids, block_expert, total, block_m = routing
    n, depth = b.shape[1], b.shape[2]
    block_n, block_k = 64, 64
    interpret = interpreting(a)
    if b_scale is not None and block is not None:
        a, a_scale = quantize_groups(a, block[1])
        scales = (a_scale, b_scale, a_scale.stride(1), b_scale.stride(0), b_scale.stride(1))
        block_k, scale_n = block[1], block[0]
    else:
        scales, scale_n = (c, c, 0, 0, 0), 1  # unread
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        a,
        b,
        c,
        sorted_ids,
        block_expert,
        total,
        weights if weights is not None else c,
        scales[0],
        scales[1],
        c.shape[0],
        n,
        depth,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        *scales[2:],
        scale_n,
        A_PER_ROW=a_per_row,
        MUL_WEIGHT=weights is not None,
        FP8=b_scale is not None,
        FP32_DOT=interpret or a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
