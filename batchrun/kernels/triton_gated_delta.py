"""Triton kernels of a Gated DeltaNet layer's decode and verify rows: the causal conv over each
request's rows from its slot's carried inputs, and the recurrent gated delta rule over them
from its slot's state (layers/ops.py's TorchOps.conv_rows and delta_rows, which they match in
float32 up to summation order).

A step's rows are packed: request r's at starts[r] .. starts[r] + lens[r] - 1 (at most `width`,
the widest a step may have: a CUDA graph's static bound), read and written in place, with no
grid of padded cells to gather or scatter. Both kernels read a request's state by its slot;
with `keep` [D] they write the slot in place, the state after its rows 0 .. keep[r] - 1 (a
decode step keeps its row, a verify's commit the accepted ones), else they only read it.
Grids are sized from tensor shapes and `width` only, so they run inside CUDA graph capture.
Requests padding a graph step (no rows) run nothing but may rewrite their shared scratch slot
as it was.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_rows", "delta_rows"]

L2_EPS = 1e-6  # as prepare_qkv's l2 norm


@triton.jit
def _window_load(x_ptr, conv_ptr, idx, c, row_ok, cmask, stride_x, stride_cc, K: tl.constexpr):
    """Window rows idx [BW] x channels c [BC]: carried input idx while idx < K - 1 (from the
    slot's state at conv_ptr), else the request's pre-conv row idx - (K - 1) (at x_ptr), in
    x's dtype."""
    in_carried = idx < K - 1
    carried = tl.load(
        conv_ptr + c[None, :] * stride_cc + idx[:, None],
        mask=(in_carried & row_ok)[:, None] & cmask[None, :],
        other=0.0,
    )
    row = idx - (K - 1)
    x = tl.load(
        x_ptr + row[:, None] * stride_x + c[None, :],
        mask=((idx >= K - 1) & row_ok)[:, None] & cmask[None, :],
        other=0.0,
    )
    return tl.where(in_carried[:, None], carried.to(x.dtype), x)


@triton.jit
def _conv_rows_kernel(
    x_ptr,
    conv_ptr,
    slots_ptr,
    starts_ptr,
    lens_ptr,
    w_ptr,
    keep_ptr,
    out_ptr,
    stride_x,
    stride_cs,
    stride_cc,
    stride_wc,
    stride_o,
    C,
    K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    KEEP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    slot = tl.load(slots_ptr + r).to(tl.int64)
    start = tl.load(starts_ptr + r).to(tl.int64)
    n = tl.load(lens_ptr + r).to(tl.int32)
    x_ptr += start * stride_x
    conv_ptr += slot * stride_cs
    t = tl.arange(0, BLOCK_W)
    tmask = t < n
    acc = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads window row t + j
        val = _window_load(x_ptr, conv_ptr, t + j, c, tmask, cmask, stride_x, stride_cc, K)
        tap = tl.load(w_ptr + c * stride_wc + j, mask=cmask, other=0.0).to(tl.float32)
        acc += val.to(tl.float32) * tap[None, :]
    out = acc * tl.sigmoid(acc)
    out_ptrs = out_ptr + (start + t[:, None]) * stride_o + c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    if KEEP:
        # The slot's next carried inputs: window rows keep .. keep + K - 2.
        keep = tl.load(keep_ptr + r)
        i = tl.arange(0, BLOCK_K)
        imask = i < K - 1
        kept = _window_load(x_ptr, conv_ptr, keep + i, c, imask, cmask, stride_x, stride_cc, K)
        # Every thread's reads of the old carried inputs land before any thread overwrites them.
        tl.debug_barrier()
        state_ptrs = conv_ptr + c[None, :] * stride_cc + i[:, None]
        tl.store(
            state_ptrs, kept.to(conv_ptr.dtype.element_ty), mask=imask[:, None] & cmask[None, :]
        )


def conv_rows(
    qkv: torch.Tensor,
    conv: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    width: int,
    weight: torch.Tensor,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    """TorchOps.conv_rows: qkv [N, C] packed rows, conv [num_slots, C, K - 1] (its last
    dimension contiguous), slots, starts, lens and keep [D], weight [C, K]; silu(conv) [N, C],
    the rows of no request left unwritten."""
    c, k = qkv.shape[1], weight.shape[1]
    out = torch.empty_like(qkv)
    d = slots.shape[0]
    if d == 0:
        return out
    if qkv.stride(-1) != 1 or conv.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    block_c = min(triton.next_power_of_2(c), 128)
    _conv_rows_kernel[(d, triton.cdiv(c, block_c))](
        qkv,
        conv,
        slots,
        starts,
        lens,
        weight,
        keep if keep is not None else lens,
        out,
        qkv.stride(0),
        conv.stride(0),
        conv.stride(1),
        weight.stride(0),
        out.stride(0),
        c,
        K=k,
        BLOCK_W=triton.next_power_of_2(width),
        BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(max(k - 1, 1)),
        KEEP=keep is not None,
        num_warps=4,
    )
    return out


@triton.jit
def _delta_rows_kernel(
    mixed_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    starts_ptr,
    counts_ptr,
    out_ptr,
    stride_m,
    stride_g,
    stride_b,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_on,
    stride_oh,
    scale,
    eps,
    REPEAT: tl.constexpr,
    KEY_DIM: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    KEEP: tl.constexpr,
    STORE_OUT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    slot = tl.load(slots_ptr + r).to(tl.int64)
    start = tl.load(starts_ptr + r).to(tl.int64)
    state_ptrs = (
        state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    )
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(state_ptrs, mask=smask, other=0.0)
    hk = h // REPEAT  # the q/k head this v head reads
    rows = tl.load(counts_ptr + r).to(tl.int32)  # its rows, or with KEEP its kept ones
    for t in range(0, rows):
        n = start + t
        row = mixed_ptr + n * stride_m
        q = tl.load(row + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(row + KEY_DIM + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KEY_DIM + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
        g = tl.load(g_ptr + n * stride_g + h)
        beta = tl.load(beta_ptr + n * stride_b + h)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        if STORE_OUT:
            o = tl.sum(s * q[:, None], 0)
            out_ptrs = out_ptr + n * stride_on + h * stride_oh + vv
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=vmask)
    if KEEP:
        tl.store(state_ptrs, s, mask=smask)


def delta_rows(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    keep: torch.Tensor | None,
    num_k_heads: int,
    head_k_dim: int,
    out: torch.Tensor | None,
) -> None:
    """TorchOps.delta_rows: mixed [N, C] packed rows, g and beta [N, Hv] float32, recurrent
    [num_slots, Hv, dk, dv] float32 (contiguous), slots, starts, lens and keep [D]; each
    request's outputs written into out [N, Hv, dv] at its rows (with keep: its kept ones; no
    out: none, as in a commit)."""
    d = slots.shape[0]
    heads, dk, dv = recurrent.shape[1:]
    if d == 0:
        return
    if not recurrent.is_contiguous() or mixed.stride(-1) != 1:
        raise ValueError("the state must be contiguous, and mixed's last dimension")
    if g.stride(-1) != 1 or beta.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("the last dimension must be contiguous")
    # A [dk, BLOCK_V] block of the state per program: 128 x 32 float32 is 32 registers a thread.
    block_v = min(triton.next_power_of_2(dv), 32)
    _delta_rows_kernel[(d, heads, triton.cdiv(dv, block_v))](
        mixed,
        g,
        beta,
        recurrent,
        slots,
        starts,
        keep if keep is not None else lens,
        out if out is not None else mixed,
        mixed.stride(0),
        g.stride(0),
        beta.stride(0),
        recurrent.stride(0),
        recurrent.stride(1),
        recurrent.stride(2),
        out.stride(0) if out is not None else 0,
        out.stride(1) if out is not None else 0,
        head_k_dim**-0.5,
        L2_EPS,
        REPEAT=heads // num_k_heads,
        KEY_DIM=num_k_heads * head_k_dim,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        KEEP=keep is not None,
        STORE_OUT=out is not None,
        num_warps=4,
    )
