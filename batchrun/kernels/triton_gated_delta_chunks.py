"""Triton kernels of a Gated DeltaNet layer's prefill chunks: a whole step's chunks, each of its
own length, in one launch per kernel (the recurrent form of triton_gated_delta.py's decode rows,
by cu offsets into the packed rows instead of a fixed width). Each chunk reads its request's
slot, conv state and recurrent state, and writes the state after its last row back in place.
A fresh request's slot is zeroed before (by the layer), so the kernels treat every chunk alike.

They match layers/gated_delta.py's causal_conv and chunked_rule in float32 up to summation
order. The recurrent form costs O(L) sequential rows per chunk; the chunked (matmul) form would
be faster on long prompts (docs/gpu-execution.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.triton_gated_delta import L2_EPS, _window_load

__all__ = ["conv_chunks", "delta_chunks"]

BLOCK_T = 16  # conv rows a program computes at once


@triton.jit
def _conv_chunks_kernel(
    x_ptr,
    conv_ptr,
    slots_ptr,
    cu_ptr,
    w_ptr,
    out_ptr,
    stride_xn,
    stride_cs,
    stride_cc,
    stride_wc,
    stride_on,
    C,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    slot = tl.load(slots_ptr + r).to(tl.int64)
    start = tl.load(cu_ptr + r).to(tl.int64)
    n = tl.load(cu_ptr + r + 1).to(tl.int32) - start.to(tl.int32)
    x_ptr += start * stride_xn
    out_ptr += start * stride_on
    conv_ptr += slot * stride_cs
    # The slot's next carried inputs, window rows n .. n + K - 2, read before any is overwritten.
    i = tl.arange(0, BLOCK_K)
    imask = i < K - 1
    kept = _window_load(x_ptr, conv_ptr, n + i, c, imask, cmask, stride_xn, stride_cc, K)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < n
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):  # tap j reads window row t + j
            val = _window_load(x_ptr, conv_ptr, t + j, c, tmask, cmask, stride_xn, stride_cc, K)
            tap = tl.load(w_ptr + c * stride_wc + j, mask=cmask, other=0.0).to(tl.float32)
            acc += val.to(tl.float32) * tap[None, :]
        out = acc * tl.sigmoid(acc)
        out_ptrs = out_ptr + t[:, None] * stride_on + c[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    # Every thread's reads of the old carried inputs land before any thread overwrites them.
    tl.debug_barrier()
    state_ptrs = conv_ptr + c[None, :] * stride_cc + i[:, None]
    tl.store(state_ptrs, kept.to(conv_ptr.dtype.element_ty), mask=imask[:, None] & cmask[None, :])


def conv_chunks(
    qkv: torch.Tensor,
    conv: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """causal_conv over each chunk: qkv [N, C] the chunks' packed rows, chunk p's rows
    cu[p] .. cu[p + 1] - 1 (cu [P + 1] int32), its state conv[slots[p]] ([num_slots, C, K - 1],
    written with the state after the chunk); weight [C, K]. silu(conv) [N, C]."""
    n, c = qkv.shape
    k = weight.shape[1]
    out = torch.empty((n, c), dtype=qkv.dtype, device=qkv.device)
    if slots.numel() == 0:
        return out
    if qkv.stride(-1) != 1 or conv.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    block_c = min(triton.next_power_of_2(c), 128)
    _conv_chunks_kernel[(slots.numel(), triton.cdiv(c, block_c))](
        qkv,
        conv,
        slots,
        cu,
        weight,
        out,
        qkv.stride(0),
        conv.stride(0),
        conv.stride(1),
        weight.stride(0),
        out.stride(0),
        c,
        K=k,
        BLOCK_T=BLOCK_T,
        BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(max(k - 1, 1)),
        num_warps=4,
    )
    return out


@triton.jit
def _delta_chunks_kernel(
    mixed_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    out_ptr,
    stride_mn,
    stride_gn,
    stride_bn,
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
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    slot = tl.load(slots_ptr + r).to(tl.int64)
    start = tl.load(cu_ptr + r).to(tl.int64)
    end = tl.load(cu_ptr + r + 1).to(tl.int64)
    state_ptrs = (
        state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    )
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(state_ptrs, mask=smask, other=0.0)
    hk = h // REPEAT  # the q/k head this v head reads
    for t in range(start, end):
        row = mixed_ptr + t * stride_mn
        q = tl.load(row + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(row + KEY_DIM + hk * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KEY_DIM + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
        g = tl.load(g_ptr + t * stride_gn + h)
        beta = tl.load(beta_ptr + t * stride_bn + h)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(
            out_ptr + t * stride_on + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vmask
        )
    tl.store(state_ptrs, s, mask=smask)


def delta_chunks(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """The gated delta rule over each chunk: mixed [N, C] (conv_chunks' output), g and beta
    [N, Hv] float32, chunk p's rows cu[p] .. cu[p + 1] - 1 from recurrent[slots[p]]
    ([num_slots, Hv, dk, dv] float32, contiguous; written with the state after the chunk).
    Outputs [N, Hv, dv] in mixed's dtype."""
    n = mixed.shape[0]
    heads, dk, dv = recurrent.shape[1:]
    out = torch.empty((n, heads, dv), dtype=mixed.dtype, device=mixed.device)
    if slots.numel() == 0:
        return out
    if not recurrent.is_contiguous() or mixed.stride(-1) != 1:
        raise ValueError("the state must be contiguous, and mixed's last dimension")
    if g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    block_v = min(triton.next_power_of_2(dv), 32)  # as delta_rows': registers a thread
    _delta_chunks_kernel[(slots.numel(), heads, triton.cdiv(dv, block_v))](
        mixed,
        g,
        beta,
        recurrent,
        slots,
        cu,
        out,
        mixed.stride(0),
        g.stride(0),
        beta.stride(0),
        recurrent.stride(0),
        recurrent.stride(1),
        recurrent.stride(2),
        out.stride(0),
        out.stride(1),
        head_k_dim**-0.5,
        L2_EPS,
        REPEAT=heads // num_k_heads,
        KEY_DIM=num_k_heads * head_k_dim,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        num_warps=4,
    )
    return out
