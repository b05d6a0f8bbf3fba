"""Batched sampling as a pure function of (logits, parameters, seed, step).

Randomness comes from a counter-based hash of (seed, step, token id) turned into Gumbel noise,
not from a generator's state: a row's sample does not depend on what else is in the batch, on
preemption, or on whether the token comes from a plain decode step or a speculative verify row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64; 0 = off
    seed: torch.Tensor  # [N] int64
    step: torch.Tensor  # [N] int64: index of the output token this row samples


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) in int64 arithmetic that never overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] standard Gumbel noise, a fixed function of each row's (seed, step)."""
    key = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (step & _MASK32))
    ids = _mix32(torch.arange(vocab, device=seed.device, dtype=torch.int64) + 0x3C6EF372)
    bits = _mix32(key[:, None] ^ ids[None, :]) >> 8  # 24 uniform bits
    u = (bits.double() + 0.5) / float(1 << 24)
    return -torch.log(-torch.log(u))


def filter_logits(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside the row's top-k and its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (top_p[:, None] < 1) & (mass_before >= top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> token ids [N]."""
    tokens = logits.argmax(dim=-1)
    rows = (batch.temperature > 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return tokens
    scaled = logits[rows].float() / batch.temperature[rows, None]
    scaled = filter_logits(scaled, batch.top_p[rows], batch.top_k[rows])
    noise = gumbel_noise(batch.seed[rows], batch.step[rows], logits.shape[-1])
    tokens[rows] = (scaled.double() + noise).argmax(dim=-1)
    return tokens
