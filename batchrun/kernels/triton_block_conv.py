"""A dynamic depthwise convolution along blocks of rows in one launch (the DFlash2 drafter's
BlockConv in its model file, whose block_conv_torch is the reference and the CPU path):

    out[t, c] = sum over taps o of (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c]

with x[t - o] zero where row t is fewer than o rows into its block of `block_size` rows. The
torch version spends about seven kernels a convolve (broadcast adds, muls, a padded copy); this
reads x once per tap (the shifted rows mostly from cache), the small kernels beside it, and
writes the output once, in float32 arithmetic.

One program per tile of BLOCK_T rows x BLOCK_C channels; a tile needs no alignment with the
blocks (each row finds its own position in its block). The grid and the output are sized from
shapes only and nothing is read back to the host, so it captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["block_conv_triton"]

# 16 x 128 channels a program: 16 elements a thread at 4 warps (two 16-byte bf16 loads), and
# at H 4096 a grid of 32 programs for one 16-row block, 1024 for 512 rows (several waves of
# an H100's 132 SMs: bandwidth-bound, not starved).
_BLOCK_T = 16
_BLOCK_C = 128


@triton.jit
def _block_conv_kernel(
    x_ptr,
    dyn_ptr,
    base_ptr,
    out_ptr,
    rows,
    hidden,
    s_xt,
    s_xc,
    s_dt,
    s_do,
    s_dg,
    s_bo,
    s_bc,
    s_ot,
    s_oc,
    TAPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    tmask = t < rows
    cmask = c < hidden
    in_block = t % BLOCK_SIZE  # the row's position in its block
    group = c // GROUP
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for o in tl.static_range(TAPS):
        # Row t - o exists in the block only o or more rows in; masked loads give the zeros.
        src = tmask & (in_block >= o)
        mask = src[:, None] & cmask[None, :]
        x = tl.load(x_ptr + (t - o)[:, None] * s_xt + c[None, :] * s_xc, mask=mask, other=0.0)
        base = tl.load(base_ptr + o * s_bo + c * s_bc, mask=cmask, other=0.0)
        dyn = tl.load(
            dyn_ptr + t[:, None] * s_dt + o * s_do + group[None, :] * s_dg,
            mask=mask,
            other=0.0,
        )
        kernel = base.to(tl.float32)[None, :] + dyn.to(tl.float32)
        acc += kernel * x.to(tl.float32)
    out_mask = tmask[:, None] & cmask[None, :]
    out_ptrs = out_ptr + t[:, None] * s_ot + c[None, :] * s_oc
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_conv_triton(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """x [rows, H] (rows a multiple of block_size), dynamic [rows, taps, H / group_size], base
    [taps, H], each in any strides and float dtype -> out [rows, H] in x's dtype."""
    rows, hidden = x.shape
    taps = base.shape[0]
    dynamic = dynamic.view(rows, taps, hidden // group_size)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, _BLOCK_T), triton.cdiv(hidden, _BLOCK_C))
    _block_conv_kernel[grid](
        x,
        dynamic,
        base,
        out,
        rows,
        hidden,
        *x.stride(),
        *dynamic.stride(),
        *base.stride(),
        *out.stride(),
        TAPS=taps,
        BLOCK_SIZE=block_size,
        GROUP=group_size,
        BLOCK_T=_BLOCK_T,
        BLOCK_C=_BLOCK_C,
        num_warps=4,
    )
    return out
