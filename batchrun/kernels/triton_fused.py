"""Small fused Triton kernels of a Qwen3 step: RMSNorm, residual add + RMSNorm, per-head q/k
RMSNorm + RoPE, and SiLU-and-mul.

Each matches the torch layers (layers/norm.py, layers/attention.py + layers/rotary.py,
layers/mlp.py) in float32 up to summation order, and in bfloat16/float16 up to the rounding noted
on each wrapper. Wrappers write into tensors the caller passes (in place where the name ends in
`_`) and launch grids sized from tensor shapes only, so they run inside CUDA graph capture. Rows
are the first dimension; the last dimension must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "fused_add_rms_norm_",
    "qk_rms_norm_rope_",
    "rms_norm",
    "rms_norm_rope_",
    "silu_and_mul",
]


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("the last dimension must be contiguous")


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), rows of x [T, N]: the float32
    norm is cast to x's dtype, then multiplied by the weight and rounded once to x's dtype (what
    torch does when the weight has x's dtype, the engine's case). `out` may be x itself."""
    num_rows, n = x.shape
    if out is None:
        out = torch.empty_like(x)
    _check_last_dim(x, out)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(num_rows,)](
        x,
        x,
        weight,
        out,
        x.stride(0),
        0,
        out.stride(0),
        eps,
        N=n,
        BLOCK=block,
        ADD_RESIDUAL=False,
        num_warps=_warps(block),
    )
    return out


def fused_add_rms_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place: residual += x (rounded to the dtype, as the torch residual add), then
    out = rms_norm(residual) (out defaults to x, overwriting it). x, residual [T, N] of one
    dtype. Returns out."""
    num_rows, n = x.shape
    if out is None:
        out = x
    _check_last_dim(x, residual, out)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual,
        weight,
        out,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        eps,
        N=n,
        BLOCK=block,
        ADD_RESIDUAL=True,
        num_warps=_warps(block),
    )
    return out


@triton.jit
def _norm_rope_heads(
    x_ptr,
    row,
    stride_t,
    stride_h,
    w_ptr,
    cos,
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < NUM_HEADS)[:, None]
    first = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + offs_d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)
    # RMSNorm's output in the input dtype, then RoPE in float32 on it.
    y1 = (w1[None, :] * (a * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2[None, :] * (b * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(first, (y1 * cos[None, :] - y2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first + HALF, (y2 * cos[None, :] + y1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    eps,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    HAS_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_d)
    _norm_rope_heads(
        q_ptr, row, stride_qt, stride_qh, qw_ptr, cos, sin, eps, Q_HEADS, BLOCK_HQ, HALF
    )
    if HAS_K:
        _norm_rope_heads(
            k_ptr, row, stride_kt, stride_kh, kw_ptr, cos, sin, eps, K_HEADS, BLOCK_HK, HALF
        )


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    head_dim = x.shape[2]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two")
    if cos.shape[1] * 2 != head_dim or sin.shape[1] * 2 != head_dim:
        raise ValueError("cos/sin tables must be [max_positions, head_dim / 2]")
    _check_last_dim(x, cos, sin)


def qk_rms_norm_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (one dtype; views of a fused projection are
    fine): per-head RMSNorm over D with q_weight/k_weight [D], then neox rotate-half RoPE from
    cos/sin [max_pos, D/2] float32 at positions [T] int64. As PagedAttention: the norm is rounded
    to the dtype, RoPE computes in float32 and rounds once (the GPU may fuse its multiply-add,
    an ulp of float32 from torch)."""
    _check_rope(q, cos, sin)
    _check_rope(k, cos, sin)
    num_rows = q.shape[0]
    if num_rows == 0:
        return
    _qk_norm_rope_kernel[(num_rows,)](
        q,
        k,
        q_weight,
        k_weight,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        eps,
        Q_HEADS=q.shape[1],
        K_HEADS=k.shape[1],
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        HALF=q.shape[2] // 2,
        HAS_K=True,
        num_warps=_warps(q.shape[1] * q.shape[2]),
    )


def rms_norm_rope_(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> None:
    """`qk_rms_norm_rope_` for one tensor x [T, H, D] (the DFlash context keys, say)."""
    _check_rope(x, cos, sin)
    num_rows = x.shape[0]
    if num_rows == 0:
        return
    _qk_norm_rope_kernel[(num_rows,)](
        x,
        x,
        weight,
        weight,
        cos,
        sin,
        positions,
        x.stride(0),
        x.stride(1),
        0,
        0,
        cos.stride(0),
        sin.stride(0),
        eps,
        Q_HEADS=x.shape[1],
        K_HEADS=1,
        BLOCK_HQ=triton.next_power_of_2(x.shape[1]),
        BLOCK_HK=1,
        HALF=x.shape[2] // 2,
        HAS_K=False,
        num_warps=_warps(x.shape[1] * x.shape[2]),
    )


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr,
    out_ptr,
    stride_gu,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + N + offs, mask=mask, other=0.0).to(tl.float32)
    # Round silu(g) to the dtype before the product, as torch's F.silu(g) * u does: the same
    # rounding keeps half-precision outputs bit-identical to the reference path.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate first, then up), computed in
    float32 and rounded once to out's dtype. The torch path (F.silu(g) * u in bf16/fp16) rounds
    silu(g) to the dtype before the multiply, so in half precision the two differ by up to about
    one ulp of the dtype; in float32 they agree to float32 rounding."""
    num_rows, width = gate_up.shape
    if width % 2:
        raise ValueError("gate_up must have an even last dimension [T, 2I]")
    n = width // 2
    if out is None:
        out = gate_up.new_empty(num_rows, n)
    _check_last_dim(gate_up, out)
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        N=n,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return out
