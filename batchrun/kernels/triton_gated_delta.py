"""Triton kernels of a Gated DeltaNet layer's decode and verify rows: the causal conv over each
request's rows from its slot's carried inputs, and the recurrent gated delta rule over them
from its slot's state (layers/ops.py's TorchOps.conv_rows and delta_rows, which they match in
float32 up to summation order).

A step's rows are packed: request r's at starts[r] .. starts[r] + lens[r] - 1 (at most `width`,
the widest a step may have: a CUDA graph's static bound), read and written in place, with no
grid of padded cells to gather or scatter. Both kernels read a request's state by its slot.
The conv, with `keep` [D], writes the slot's carried inputs after rows 0 .. keep[r] - 1 (a
decode step keeps its row, a verify's commit the accepted ones), else only reads them. The
rule first applies the rows the slot's last verify kept (layers/ops.py's KeptRows), then a
decode step's row, writing the state once; a verify step writes the state only if it had kept
rows to apply, and stages its own rows for the commit.
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
    lens_ptr,
    out_ptr,
    count_ptr,
    buffer_ptr,
    kv_ptr,
    kg_ptr,
    kbeta_ptr,
    stride_m,
    stride_g,
    stride_b,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_on,
    stride_oh,
    stride_ks,
    stride_kb,
    stride_kw,
    stride_gs,
    stride_gb,
    stride_gw,
    scale,
    eps,
    REPEAT: tl.constexpr,
    KEY_DIM: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UPDATE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vblock = tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    slot = tl.load(slots_ptr + r).to(tl.int64)
    start = tl.load(starts_ptr + r).to(tl.int64)
    state_ptrs = (
        state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    )
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(state_ptrs, mask=smask, other=0.0)
    hk = h // REPEAT  # the q/k head this v head reads
    # The rows the slot's last verify kept (KeptRows): k and v, no q (no output is wanted).
    pending = tl.load(count_ptr + slot)
    buffer = tl.load(buffer_ptr + slot).to(tl.int64)
    for t in range(0, pending):
        row = kv_ptr + slot * stride_ks + buffer * stride_kb + t * stride_kw
        k = tl.load(row + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(row + KEY_DIM + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
        gated = slot * stride_gs + buffer * stride_gb + t * stride_gw + h
        s = s * tl.exp(tl.load(kg_ptr + gated))
        delta = (v - tl.sum(s * k[:, None], 0)) * tl.load(kbeta_ptr + gated)
        s = s + k[:, None] * delta[None, :]
    # A constexpr and a runtime test: nested (Triton compiles no `and` of the two).
    if not UPDATE:  # noqa: SIM102
        if pending > 0:  # the state the kept rows leave: the slot's from now on
            tl.store(state_ptrs, s, mask=smask)
    # This step's rows: staged (a verify step's) in the slot's other buffer, for the commit.
    stage = kv_ptr + slot * stride_ks + (1 - buffer) * stride_kb
    staged = slot * stride_gs + (1 - buffer) * stride_gb + h
    rows = tl.load(lens_ptr + r).to(tl.int32)
    for t in range(0, rows):
        n = start + t
        row = mixed_ptr + n * stride_m
        q = tl.load(row + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        k_in = tl.load(row + KEY_DIM + hk * DK + kk, mask=kmask, other=0.0)
        v_in = tl.load(row + 2 * KEY_DIM + h * DV + vv, mask=vmask, other=0.0)
        k, v = k_in.to(tl.float32), v_in.to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
        g = tl.load(g_ptr + n * stride_g + h)
        beta = tl.load(beta_ptr + n * stride_b + h)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(
            out_ptr + n * stride_on + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vmask
        )
        if not UPDATE:
            dst = stage + t * stride_kw
            kv_ty = kv_ptr.dtype.element_ty
            tl.store(dst + KEY_DIM + h * DV + vv, v_in.to(kv_ty), mask=vmask)
            if vblock == 0:
                tl.store(kg_ptr + staged + t * stride_gw, g)
                tl.store(kbeta_ptr + staged + t * stride_gw, beta)
                if h % REPEAT == 0:  # one program stages each k head's row
                    tl.store(dst + hk * DK + kk, k_in.to(kv_ty), mask=kmask)
    if UPDATE:
        tl.store(state_ptrs, s, mask=smask)


def delta_rows(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    kept: tuple[torch.Tensor, ...],
    update: bool,
    num_k_heads: int,
    head_k_dim: int,
    out: torch.Tensor,
) -> None:
    """TorchOps.delta_rows: mixed [N, C] packed rows, g and beta [N, Hv] float32, recurrent
    [num_slots, Hv, dk, dv] float32 (contiguous), slots, starts and lens [D]; each request's
    state first takes its slot's pending kept rows, then its outputs are written into out
    [N, Hv, dv] at its rows; update: the slot takes the rows, else they are staged. kept:
    KeptRows' (count, buffer, kv, g, beta)."""
    count, buffer, kept_kv, kept_g, kept_beta = kept
    d = slots.shape[0]
    heads, dk, dv = recurrent.shape[1:]
    if d == 0:
        return
    if not recurrent.is_contiguous() or mixed.stride(-1) != 1:
        raise ValueError("the state must be contiguous, and mixed's last dimension")
    if g.stride(-1) != 1 or beta.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    if kept_g.stride() != kept_beta.stride() or kept_kv.stride(-1) != 1 or kept_g.stride(-1) != 1:
        raise ValueError("the kept rows: last dimensions contiguous, g and beta of one layout")
    # A [dk, BLOCK_V] block of the state per program: 128 x 32 float32 is 32 registers a thread.
    block_v = min(triton.next_power_of_2(dv), 32)
    _delta_rows_kernel[(d, heads, triton.cdiv(dv, block_v))](
        mixed,
        g,
        beta,
        recurrent,
        slots,
        starts,
        lens,
        out,
        count,
        buffer,
        kept_kv,
        kept_g,
        kept_beta,
        mixed.stride(0),
        g.stride(0),
        beta.stride(0),
        recurrent.stride(0),
        recurrent.stride(1),
        recurrent.stride(2),
        out.stride(0),
        out.stride(1),
        kept_kv.stride(0),
        kept_kv.stride(1),
        kept_kv.stride(2),
        kept_g.stride(0),
        kept_g.stride(1),
        kept_g.stride(2),
        head_k_dim**-0.5,
        L2_EPS,
        REPEAT=heads // num_k_heads,
        KEY_DIM=num_k_heads * head_k_dim,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        UPDATE=update,
        num_warps=4,
    )
