"""Gumbel-max sampling of rows without top-k/top-p in one pass over the logits, token for token
what the torch sampler draws (batchrun/sampling/sampler.py, `_draw_plain`):

    token = argmax_j(float32(logits[j]) / T + g_j),  g_j = -log(-log(u_j)),
    u_j = philox_uniform(seed, step, j)                (batchrun/sampling/philox.py)

and the plain argmax (first index on ties, NaN counting as the largest, as torch.argmax) for rows
with T <= 0. The torch path materialises eight int64 Philox words per logit; here each program
owns a row, regenerates the noise block by block in uint32 registers and keeps a running
(value, index) maximum per lane, so memory traffic is one read of the logits.

Identical tokens need identical float32 values, so every step is the one torch takes: Philox in
uint32 wrap-around (`umulhi` for the high words), an IEEE-rounded division (`div_rn`: Triton's `/`
compiles to the approximate div.full.f32 on NVIDIA GPUs), and on the GPU libdevice's `__nv_logf`,
the logf behind torch's CUDA `log` (`tl.log` promises no such bits). On an H200 the noise matches
gumbel_noise bit for bit. Triton's CPU interpreter has no libdevice and uses numpy's log, so on
the CPU the noise can differ from torch's in the last bits (tokens only at near-ties).

`sample_plain` allocates nothing when given `out` and sizes its grid from shapes only, so it can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchrun.sampling import philox

__all__ = ["BLOCK", "philox_debug", "sample_plain"]

# Logits per loop step and warps per row: 16 warps fill an SM with four rows in flight, the
# fastest of 256..4096 x 4..16 at a Qwen3 vocabulary (docs/benchmarks.md, Kernel tuning).
BLOCK = 4096
_WARPS = 16
_DEBUG_BLOCK = 1024

_M0 = tl.constexpr(philox.M0)
_M1 = tl.constexpr(philox.M1)
_W0 = tl.constexpr(philox.W0)
_W1 = tl.constexpr(philox.W1)
_ROUNDS = tl.constexpr(philox.ROUNDS)
_MASK32 = tl.constexpr(philox.MASK32)


@triton.jit
def _philox_4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of uint32 words: the round and key schedule of philox.py."""
    for _ in tl.static_range(_ROUNDS):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        # Bumped after every round, so round r runs with r bumps; the last one is dead code.
        k0 = k0 + _W0
        k1 = k1 + _W1
    return c0, c1, c2, c3


@triton.jit
def _row_words(seed_ptr, step_ptr, row, ids):
    """The four Philox words of (the row's seed, its step, token ids): uint32 tensors like ids."""
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    # Masks after the arithmetic shift read the int64 as the unsigned 64-bit value.
    k0 = (seed & _MASK32).to(tl.uint32)
    k1 = ((seed >> 32) & _MASK32).to(tl.uint32)
    zero = tl.zeros_like(ids)
    s0 = zero + (step & _MASK32).to(tl.uint32)
    s1 = zero + ((step >> 32) & _MASK32).to(tl.uint32)
    return _philox_4x32_10(s0, s1, ids, zero, k0, k1)


@triton.jit
def stream_uniform(seed, step, STREAM: tl.constexpr):
    """draft_verify.stream_uniform of one int64 seed and step: word 0 of Philox-4x32-10 at
    counter (step, 0, STREAM) under the seed's key, as a float32 in (0, 1), bit for bit."""
    k0 = (seed & _MASK32).to(tl.uint32)
    k1 = ((seed >> 32) & _MASK32).to(tl.uint32)
    s0 = (step & _MASK32).to(tl.uint32)
    s1 = ((step >> 32) & _MASK32).to(tl.uint32)
    zero = s0 * 0
    x0 = _philox_4x32_10(s0, s1, zero, zero + STREAM, k0, k1)[0]
    return tl.maximum((x0 >> 8).to(tl.float32), 0.5) * 5.9604644775390625e-08  # 2^-24, exact


@triton.jit
def _gumbel(x0, LIBDEVICE: tl.constexpr):
    """float32 standard Gumbel noise from Philox word 0, as sampler.gumbel_noise computes it."""
    u = tl.maximum((x0 >> 8).to(tl.float32), 0.5) * 5.9604644775390625e-08  # 2^-24, exact
    if LIBDEVICE:
        return -libdevice.log(-libdevice.log(u))
    else:
        return -tl.log(-tl.log(u))


@triton.jit
def _first_max(v1, i1, v2, i2):
    """torch.argmax's order: NaN above everything, then the larger value, then the lower index."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    tie = (v1 == v2) | (nan1 & nan2)
    first = (v1 > v2) | (nan1 & ~nan2) | (tie & (i1 < i2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2)


@triton.jit
def gumbel_argmax(
    logits_ptr,
    temp_ptr,
    seed_ptr,
    step_ptr,
    out_ptr,
    V,
    stride_row,
    stride_col,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    sampled = t > 0
    lanes = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = lanes
    base = logits_ptr + row * stride_row
    for start in range(0, V, BLOCK):
        ids = start + lanes
        mask = ids < V
        x = tl.load(base + ids.to(tl.int64) * stride_col, mask=mask, other=0.0).to(tl.float32)
        if sampled:
            x0, _, _, _ = _row_words(seed_ptr, step_ptr, row, ids.to(tl.uint32))
            x = tl.div_rn(x, t) + _gumbel(x0, LIBDEVICE)
        x = tl.where(mask, x, float("-inf"))
        # Each lane sees its ids in increasing order, so a tie keeps the earlier one.
        best_v, best_i = _first_max(best_v, best_i, x, ids)
    _, token = tl.reduce((best_v, best_i), 0, _first_max)
    tl.store(out_ptr + row, token.to(tl.int64))


def _libdevice(t: torch.Tensor) -> bool:
    return t.is_cuda and not triton.knobs.runtime.interpret


def sample_plain(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
) -> torch.Tensor:
    """Tokens [N] int64 for logits [N, V] (float32/bfloat16/float16, any strides): Gumbel-max
    with the row's Philox noise where temperature [N] float32 > 0, else the argmax. seed and
    step are [N] int64 (seeds >= 2^63 in two's complement). `block` (a power of two) is for tests
    that cross block boundaries at tiny vocabularies."""
    num_rows, vocab = logits.shape
    for name, t in (("temperature", temperature), ("seed", seed), ("step", step)):
        if t.shape != (num_rows,) or t.device != logits.device:
            raise ValueError(f"{name} must be [{num_rows}] on {logits.device}")
    if temperature.dtype != torch.float32 or torch.int64 != seed.dtype or torch.int64 != step.dtype:
        raise ValueError("temperature must be float32, seed and step int64")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    gumbel_argmax[(num_rows,)](
        logits,
        temperature.contiguous(),
        seed.contiguous(),
        step.contiguous(),
        out,
        vocab,
        logits.stride(0),
        logits.stride(1),
        BLOCK=block,
        LIBDEVICE=_libdevice(logits),
        num_warps=_WARPS,
    )
    return out


@triton.jit
def _philox_debug_kernel(
    seed_ptr,
    step_ptr,
    ids_ptr,
    words_ptr,
    noise_ptr,
    M,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < M
    ids = (tl.load(ids_ptr + row * M + j, mask=mask, other=0) & _MASK32).to(tl.uint32)
    c0, c1, c2, c3 = _row_words(seed_ptr, step_ptr, row, ids)
    at = words_ptr + (row * M + j) * 4
    tl.store(at, c0.to(tl.int64), mask=mask)
    tl.store(at + 1, c1.to(tl.int64), mask=mask)
    tl.store(at + 2, c2.to(tl.int64), mask=mask)
    tl.store(at + 3, c3.to(tl.int64), mask=mask)
    tl.store(noise_ptr + row * M + j, _gumbel(c0, LIBDEVICE), mask=mask)


def philox_debug(
    seed: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For tests: the kernels' Philox words [N, M, 4] (int64 holding uint32) and Gumbel noise
    [N, M] float32 of seed, step [N] int64 and token_ids [N, M] int64 (each < 2^32)."""
    num_rows, m = token_ids.shape
    words = torch.empty(num_rows, m, 4, dtype=torch.int64, device=token_ids.device)
    noise = torch.empty(num_rows, m, dtype=torch.float32, device=token_ids.device)
    if words.numel():
        _philox_debug_kernel[(num_rows, triton.cdiv(m, _DEBUG_BLOCK))](
            seed.contiguous(),
            step.contiguous(),
            token_ids.contiguous(),
            words,
            noise,
            m,
            BLOCK=_DEBUG_BLOCK,
            LIBDEVICE=_libdevice(token_ids),
        )
    return words, noise
