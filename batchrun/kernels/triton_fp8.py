"""Block-scaled FP8 matmul: y = x @ W^T with W in float8_e4m3fn, one float32 scale per
block_n x block_k block of W (Qwen's -FP8 checkpoints: 128 x 128), and x quantized to
float8_e4m3fn in groups of block_k columns per row (dynamic activation scales, as those
checkpoints ask). Each k step feeds an fp8 tensor-core dot whose float32 result is scaled by the
row's and the weight block's scales.

The activations are quantized either inside the matmul's loop (each k step takes its tile's row
maxima: no kernel of its own, which pays at a few rows) or ahead by `quantize_groups`, so that
the loop streams fp8 tiles of both operands (which pays from tens of rows, where every column
tile would otherwise quantize the same rows again).

Decode is bound by reading W: small batches split K across programs to keep enough loads in
flight on every SM. Each part stores its partial sum; the last part of a tile to finish (a
counter per tile) adds them and writes the output, so a split matmul is still one launch with
no zeroed buffer and no conversion kernel after it. The tile choice is in `tile_for` (measured
on the H200: bench/results/fp8-gemm-h200.json).
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


# quantize_groups: rows per program, in two warps. One row a program (256 bytes) made it 15% of
# the FP8 W1 job's GPU time; eight is faster at prefill's thousands of rows and at decode's
# hundred (docs/benchmarks.md, Kernel tuning).
QUANTIZE_ROWS = 8


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    ahead: bool = False  # activations quantized by quantize_groups first, not in the loop


def tile_for(m: int, n: int, k: int, block_k: int) -> Tile:
    """The tile for an [m, k] x [k, n] product: the fastest measured at Qwen3-8B's projections
    on the H200 (bench/results/fp8-gemm-h200.json). Up to 16 rows, activations quantized in
    the loop, 128 columns a program and K split so that about 384 programs read W (down_proj,
    o_proj and qkv_proj in 8 parts, gate_up_proj in 2); from 17 rows, activations quantized
    ahead, 64 x 64 tiles and K split in up to 4 parts towards 384 programs."""
    if m <= 16:
        split = max(1, min(8, 384 // triton.cdiv(n, 128), triton.cdiv(k, block_k)))
        return Tile(16, 128, split, 4, 3)
    if m <= 256:
        programs = triton.cdiv(m, 64) * triton.cdiv(n, 64)
        split = 1
        while split < 4 and programs * split * 2 <= 384:
            split *= 2
        return Tile(64, 64, split, 4, 3, ahead=True)
    return Tile(128, 128, 1, 8, 4, ahead=True)


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
    _quantize_groups[(triton.cdiv(rows, QUANTIZE_ROWS), groups)](
        x,
        quantized,
        scales,
        m,
        k,
        x.stride(0),
        rows,
        GROUP=group,
        BLOCK_R=QUANTIZE_ROWS,
        INTERPRET=_INTERPRET,
        num_warps=2,
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
    split = triton.cdiv(k_steps, steps_per_split)  # no empty part
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), split)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if tile.ahead:
        x, x_scales = quantize_groups(x, block_k)
        stride_xs = x_scales.stride(1)  # a group's scales are one column of m
    else:
        x_scales, stride_xs = out, 0  # unread
    if split > 1:
        partials = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        counters = _tile_counters(x.device, grid[0] * grid[1])
    else:
        partials = counters = out  # unread
    _fp8_block_matmul[grid](
        x,
        x_scales,
        weight,
        scale,
        out,
        partials,
        counters,
        m,
        n,
        k,
        x.stride(0),
        stride_xs,
        weight.stride(0),
        scale.stride(0),
        steps_per_split,
        block_n,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        X_FP8=tile.ahead,
        SPLIT=split > 1,
        INTERPRET=_INTERPRET,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, that the kernel leaves zeroed: kept per
    device (first made in a warm-up call, before any CUDA graph captures the kernel)."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _counters[device] = torch.zeros(
            max(tiles, 4096), device=device, dtype=torch.int32
        )
    return counters


@triton.jit
def _fp8_block_matmul(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_x,
    stride_xs,
    stride_w,
    stride_s,
    steps_per_split,
    block_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    scale_rows = s_ptr + (cols // block_n) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    for step in range(first, last):
        k = step * BLOCK_K + ks
        k_ok = k < K
        x_at = x_ptr + rows[:, None] * stride_x + k[None, :]
        x_mask = row_ok[:, None] & k_ok[None, :]
        if X_FP8:
            x_q = tl.load(x_at, mask=x_mask, other=0.0)
            x_scale = tl.load(xs_ptr + step * stride_xs + rows, mask=row_ok, other=0.0)
            if INTERPRET:
                x_q = x_q.to(tl.float32)
        else:
            x = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
            x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
            x_q = x / x_scale[:, None]
            x_q = e4m3_rounded(x_q) if INTERPRET else x_q.to(tl.float8e4nv)
        w = tl.load(
            w_ptr + cols[None, :] * stride_w + k[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        w_scale = tl.load(scale_rows + step, mask=col_ok, other=0.0)
        dot = tl.dot(x_q, w.to(tl.float32)) if INTERPRET else tl.dot(x_q, w)
        acc += dot * x_scale[:, None] * w_scale[None, :]
    at = rows[:, None] * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + tl.program_id(2) * M * N + at, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial stored before the counter says so
        tile = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        parts = tl.num_programs(2)
        if tl.atomic_add(tile, 1, sem="acq_rel") == parts - 1:  # the tile's last part
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for part in range(0, parts):  # from L2: the other parts' SMs wrote them there
                acc += tl.load(part_ptr + part * M * N + at, mask=ok, cache_modifier=".cg")
            tl.atomic_xchg(tile, 0)  # zeroed for the next call
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quantize_groups(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_x,
    ROWS,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    k_ok = k < K
    x = tl.load(
        x_ptr + rows[:, None] * stride_x + k[None, :],
        mask=(rows < M)[:, None] & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    q = x / scale[:, None]
    q = e4m3_rounded(q) if INTERPRET else q
    row_ok = rows < ROWS  # rows past M (padding) are zeros
    tl.store(
        q_ptr + rows[:, None] * K + k[None, :],
        q.to(tl.float8e4nv),
        mask=row_ok[:, None] & k_ok[None, :],
    )
    tl.store(s_ptr + tl.program_id(1) * ROWS + rows, scale, mask=row_ok)
