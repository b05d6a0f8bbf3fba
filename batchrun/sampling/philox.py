"""Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
counter-based generator behind the sampler's noise, in torch int64 arithmetic.

Every 32-bit word is held in an int64 tensor with values in [0, 2^32); products are split into
16-bit halves so that no intermediate reaches 2^63, so CPU and GPU give the same bits, and a
Triton kernel (uint32 words, `umulhi`) can reproduce them exactly.

One round, with M0 = 0xD2511F53, M1 = 0xCD9E8D57, hi/lo the upper/lower 32 bits of a 64-bit
product:

    (c0, c1, c2, c3) <- (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))

Philox-4x32-10 runs ten rounds; before each round after the first the key is bumped:
k0 += 0x9E3779B9, k1 += 0xBB67AE85 (mod 2^32). This is Random123's philox4x32_R(10, ...).

The sampler's uniform for (seed, step, token id), all three 64-bit integers:

    key     = (seed mod 2^32, seed >> 32)            (seed as an unsigned 64-bit value)
    counter = (step mod 2^32, step >> 32, token id, 0)
    x0      = word 0 of philox4x32_10(counter, key)
    u       = max(x0 >> 8, 0.5) * 2^-24              (24 bits, exact in float32, in (0, 1))

so a row's noise is a fixed function of its own seed, token index and token id, and two rows
share noise only if all 64 bits of their seeds and of their token indices agree.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of m * a for 32-bit words a and constant m, below 2^63 throughout:
    m * a = (a * m_hi) * 2^16 + a * m_lo, each partial product < 2^48. In place on its own
    temporaries, so at most three of a's size are alive at once."""
    hi = a * (m >> 16)
    lo = a * (m & 0xFFFF)
    lo += (hi & 0xFFFF).bitwise_left_shift_(16)
    hi.bitwise_right_shift_(16)
    hi += lo >> 32
    return hi, lo.bitwise_and_(MASK32)


def philox4x32_10(counter: Words, key: tuple[torch.Tensor, torch.Tensor]) -> Words:
    """Philox-4x32-10 of broadcastable int64 tensors of 32-bit words (values in [0, 2^32))."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(c0, M0)
        del c0  # drop each word as soon as it is used: the state is four full-size tensors
        hi1, lo1 = _mulhilo(c2, M1)
        del c2
        c0 = hi1 ^ c1 ^ k0
        del hi1, c1
        c2 = hi0 ^ c3 ^ k1
        del hi0, c3
        c1, c3 = lo1, lo0
    return c0, c1, c2, c3


def split64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 32-bit words of int64 values read as unsigned 64-bit integers."""
    return x & MASK32, (x >> 32) & MASK32


def philox_uniform(seed: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) for every (row, token id): seed and step are [N] int64 (a seed
    >= 2^63 in two's complement), token_ids is [M] (shared by every row) or [N, M] int64.
    Returns [N, M]; see the module docstring for the exact formula."""
    key = tuple(w[:, None] for w in split64(seed))
    s_lo, s_hi = (w[:, None] for w in split64(step))
    ids = token_ids if token_ids.dim() == 2 else token_ids[None, :]
    x0 = philox4x32_10((s_lo, s_hi, ids, torch.zeros_like(s_lo)), (key[0], key[1]))[0]
    u = (x0 >> 8).float()
    return u.clamp_(min=0.5).mul_(2.0**-24)
