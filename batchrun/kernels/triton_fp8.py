"""Block-scaled FP8 matmul: y = x @ W^T with W in float8_e4m3fn, one float32 scale per
block_n x block_k block of W (Qwen's -FP8 checkpoints: 128 x 128), and x quantized on the fly
to float8_e4m3fn in groups of block_k columns per row (dynamic activation scales, as those
checkpoints ask). The activation quantization is fused into the matmul: each k step loads a
[BLOCK_M, block_k] tile of x, takes its rows' absolute maxima, and feeds the quantized tile to
an fp8 tensor-core dot whose float32 result is scaled by the row's and the weight block's scales.

Decode is bound by reading W: small batches split K across programs (their partial sums added
atomically into a float32 buffer) to keep enough loads in flight on every SM; large batches
tile M and N. The tile choice is in `tile_for` (measured on the H200:
bench/results/fp8-gemm-h200.json).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchrun.kernels.e4m3 import e4m3_rounded

# Under the interpreter the activations are rounded to e4m3 by e4m3_rounded (its own float8
# cast loses the carry of a rounding that crosses a power of two, 31.2 -> 16) and the dot takes
# float32 operands holding the same values.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


def tile_for(m: int, n: int, k: int, block_k: int) -> Tile:
    """The tile for an [m, k] x [k, n] product: the fastest measured at Qwen3-8B's projections
    on the H200 (bench/results/fp8-gemm-h200.json). Up to 16 rows, 128 columns a program and K
    split so that about 384 programs read W (down_proj, o_proj and qkv_proj in 8 parts,
    gate_up_proj in 2)."""
    if m <= 16:
        split = max(1, min(8, 384 // triton.cdiv(n, 128), triton.cdiv(k, block_k)))
        return Tile(16, 128, split, 4, 3)
    if m <= 32:
        return Tile(32, 64, 1, 4, 4)
    if m <= 256:
        return Tile(64, 128, 1, 4, 4)
    return Tile(128, 128, 1, 8, 4)


def quantize_groups(
    x: torch.Tensor, group: int, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8_e4m3fn in groups of `group` columns per row, and the groups' float32
    scales [M, K / group], laid out column by column (cuBLAS's blockwise scaled matmul reads
    them so); with `rows` > M, zero rows pad both to that many."""
    m, k = x.shape
    rows = rows or m
    groups = triton.cdiv(k, group)
    quantized = torch.empty(rows, k, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(groups, rows, device=x.device, dtype=torch.float32)
    _quantize_groups[(rows, groups)](
        x, quantized, scales, m, k, x.stride(0), rows, GROUP=group, INTERPRET=_INTERPRET
    )
    return quantized, scales.t()


def fp8_block_matmul(
    x: torch.Tensor,  # [M, K] bfloat16 / float16 / float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int],
    tile: Tile | None = None,
) -> torch.Tensor:
    """x @ dequantized(weight)^T in x's dtype, [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k = block
    tile = tile or tile_for(m, n, k, block_k)
    k_steps = triton.cdiv(k, block_k)
    steps_per_split = triton.cdiv(k_steps, tile.split_k)
    split = triton.cdiv(k_steps, steps_per_split)  # no empty split
    if split > 1:
        out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), split)
    _fp8_block_matmul[grid](
        x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), scale.stride(0),
        steps_per_split, block_n,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, ATOMIC=split > 1,
        INTERPRET=_INTERPRET, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out.to(x.dtype) if split > 1 else out


@triton.jit
def _fp8_block_matmul(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s,
    steps_per_split, block_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    scale_rows = s_ptr + (cols // block_n) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * steps_per_split
    for step in range(first, first + steps_per_split):
        k = step * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        x_q = x / x_scale[:, None]
        x_q = e4m3_rounded(x_q) if INTERPRET else x_q.to(tl.float8e4nv)
        w = tl.load(
            w_ptr + cols[None, :] * stride_w + k[:, None],
            mask=col_ok[None, :] & k_ok[:, None], other=0.0,
        )  # fmt: skip
        step_ok = cols * 0 + step * BLOCK_K < K  # the last split may run past K
        w_scale = tl.load(scale_rows + step, mask=col_ok & step_ok, other=0.0)
        dot = tl.dot(x_q, w.to(tl.float32)) if INTERPRET else tl.dot(x_q, w)
        acc += dot * x_scale[:, None] * w_scale[None, :]
    at = out_ptr + rows[:, None] * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(at, acc, mask=ok, sem="relaxed")
    else:
        tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quantize_groups(
    x_ptr, q_ptr, s_ptr, M, K, stride_x, ROWS, GROUP: tl.constexpr, INTERPRET: tl.constexpr
):
    row, group = tl.program_id(0), tl.program_id(1)
    k = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + k, mask=(k < K) & (k * 0 + row < M), other=0.0).to(
        tl.float32
    )
    scale = tl.maximum(tl.max(tl.abs(x)), 1e-12) / 448.0
    q = x / scale
    q = e4m3_rounded(q) if INTERPRET else q
    tl.store(q_ptr + row * K + k, q.to(tl.float8e4nv), mask=k < K)
    tl.store(s_ptr + group * ROWS + row, scale)
