"""Triton kernels of a Gated DeltaNet layer's decode and verify rows: the causal conv over each
request's W rows from its slot's carried inputs, and the recurrent gated delta rule over them
from its slot's state (layers/gated_delta.py's conv_rows and delta_rows, which they match in
float32 up to summation order).

Both read a request's state by its slot; with `keep` [D] they write the slot in place, the
state after rows 0 .. keep[r] - 1 (a decode step keeps every row, a verify's commit the
accepted ones), else they only read it. `rows` [D] (a verify's own rows per request, the kept
ones in a commit) bounds the work: a graph's grid is as wide as the job's widest verify, and a
request's cells past its rows are left unwritten. Grids are sized from tensor shapes only, so
they run inside CUDA graph capture. Requests padding a graph step may share one slot: their
writes race, but the slot they share is the scratch slot, which nothing reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_rows", "delta_rows"]

L2_EPS = 1e-6  # as prepare_qkv's l2 norm


@triton.jit
def _window_load(x_ptr, conv_ptr, idx, c, row_ok, cmask, stride_xw, stride_cc, K: tl.constexpr):
    """Window rows idx [BW] x channels c [BC]: carried input idx while idx < K - 1 (from the
    slot's state at conv_ptr), else pre-conv row idx - (K - 1) (at x_ptr), in x's dtype."""
    in_carried = idx < K - 1
    carried = tl.load(
        conv_ptr + c[None, :] * stride_cc + idx[:, None],
        mask=(in_carried & row_ok)[:, None] & cmask[None, :],
        other=0.0,
    )
    row = idx - (K - 1)
    x = tl.load(
        x_ptr + row[:, None] * stride_xw + c[None, :],
        mask=((idx >= K - 1) & row_ok)[:, None] & cmask[None, :],
        other=0.0,
    )
    return tl.where(in_carried[:, None], carried.to(x.dtype), x)


@triton.jit
def _conv_rows_kernel(
    x_ptr,
    conv_ptr,
    slots_ptr,
    w_ptr,
    keep_ptr,
    rows_ptr,
    out_ptr,
    stride_xd,
    stride_xw,
    stride_cs,
    stride_cc,
    stride_wc,
    stride_od,
    stride_ow,
    W,
    C,
    K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    KEEP: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    slot = tl.load(slots_ptr + r).to(tl.int64)
    x_ptr += r * stride_xd
    conv_ptr += slot * stride_cs
    t = tl.arange(0, BLOCK_W)
    n = W
    if ROWS:
        n = tl.load(rows_ptr + r).to(tl.int32)
    tmask = t < n
    acc = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads window row t + j
        val = _window_load(x_ptr, conv_ptr, t + j, c, tmask, cmask, stride_xw, stride_cc, K)
        tap = tl.load(w_ptr + c * stride_wc + j, mask=cmask, other=0.0).to(tl.float32)
        acc += val.to(tl.float32) * tap[None, :]
    out = acc * tl.sigmoid(acc)
    out_ptrs = out_ptr + r * stride_od + t[:, None] * stride_ow + c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    if KEEP:
        # The slot's next carried inputs: window rows keep .. keep + K - 2.
        keep = tl.load(keep_ptr + r)
        i = tl.arange(0, BLOCK_K)
        imask = i < K - 1
        kept = _window_load(x_ptr, conv_ptr, keep + i, c, imask, cmask, stride_xw, stride_cc, K)
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
    weight: torch.Tensor,
    keep: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """layers/gated_delta.py's conv_rows: qkv [D, W, C], conv [num_slots, C, K - 1] (its last
    dimension contiguous), slots, keep and rows [D], weight [C, K]; silu(conv) [D, W, C], with
    rows: request r's rows from rows[r] on unwritten."""
    d, w, c = qkv.shape
    k = weight.shape[1]
    out = torch.empty((d, w, c), dtype=qkv.dtype, device=qkv.device)
    if d == 0:
        return out
    if qkv.stride(-1) != 1 or conv.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    block_c = min(triton.next_power_of_2(c), 128)
    _conv_rows_kernel[(d, triton.cdiv(c, block_c))](
        qkv,
        conv,
        slots,
        weight,
        keep if keep is not None else slots,
        rows if rows is not None else slots,
        out,
        qkv.stride(0),
        qkv.stride(1),
        conv.stride(0),
        conv.stride(1),
        weight.stride(0),
        out.stride(0),
        out.stride(1),
        w,
        c,
        K=k,
        BLOCK_W=triton.next_power_of_2(w),
        BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(max(k - 1, 1)),
        KEEP=keep is not None,
        ROWS=rows is not None,
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
    keep_ptr,
    rows_ptr,
    out_ptr,
    stride_md,
    stride_mw,
    stride_gd,
    stride_gw,
    stride_bd,
    stride_bw,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_od,
    stride_ow,
    stride_oh,
    W,
    scale,
    eps,
    REPEAT: tl.constexpr,
    KEY_DIM: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    KEEP: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    slot = tl.load(slots_ptr + r).to(tl.int64)
    state_ptrs = (
        state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    )
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(state_ptrs, mask=smask, other=0.0)
    hk = h // REPEAT  # the q/k head this v head reads
    rows = W
    if KEEP:
        rows = tl.load(keep_ptr + r).to(tl.int32)
    elif ROWS:
        rows = tl.load(rows_ptr + r).to(tl.int32)
    for t in range(0, rows):
        row = mixed_ptr + r * stride_md + t * stride_mw
        q = tl.load(row + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(row + KEY_DIM + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KEY_DIM + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
        g = tl.load(g_ptr + r * stride_gd + t * stride_gw + h)
        beta = tl.load(beta_ptr + r * stride_bd + t * stride_bw + h)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        out_ptrs = out_ptr + r * stride_od + t * stride_ow + h * stride_oh + vv
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=vmask)
    if KEEP:
        tl.store(state_ptrs, s, mask=smask)


def delta_rows(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor | None,
    num_k_heads: int,
    head_k_dim: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """layers/gated_delta.py's delta_rows: mixed [D, W, C], g and beta [D, W, Hv] float32,
    recurrent [num_slots, Hv, dk, dv] float32 (contiguous), slots, keep and rows [D]; outputs
    [D, W, Hv, dv] in mixed's dtype, request r's from keep[r] on (else from rows[r] on) left
    unwritten."""
    d, w, _ = mixed.shape
    heads, dk, dv = recurrent.shape[1:]
    out = torch.empty((d, w, heads, dv), dtype=mixed.dtype, device=mixed.device)
    if d == 0:
        return out
    if not recurrent.is_contiguous() or mixed.stride(-1) != 1:
        raise ValueError("the state must be contiguous, and mixed's last dimension")
    if g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    # A [dk, BLOCK_V] block of the state per program: 128 x 32 float32 is 32 registers a thread.
    block_v = min(triton.next_power_of_2(dv), 32)
    _delta_rows_kernel[(d, heads, triton.cdiv(dv, block_v))](
        mixed,
        g,
        beta,
        recurrent,
        slots,
        keep if keep is not None else slots,
        rows if rows is not None else slots,
        out,
        mixed.stride(0),
        mixed.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        recurrent.stride(0),
        recurrent.stride(1),
        recurrent.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        w,
        head_k_dim**-0.5,
        L2_EPS,
        REPEAT=heads // num_k_heads,
        KEY_DIM=num_k_heads * head_k_dim,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        KEEP=keep is not None,
        ROWS=rows is not None,
        num_warps=4,
    )
    return out
