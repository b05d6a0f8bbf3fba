"""Logits split by vocabulary slice across the ranks: the greedy token and the full rows."""

from __future__ import annotations

import torch

from batchrun.parallel.group import TensorParallel, slice_bounds


def first_best(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The token of each row [T] from every rank's best (value, vocabulary index) [W, T], ranks
    holding ascending vocabulary slices: the highest value, and among equals the lowest index,
    as torch.argmax over the whole row picks (a NaN counts as the highest, as there)."""
    best = values.max(0).values  # NaN where any rank's best is NaN
    hit = (values == best) | values.isnan()
    rank = hit.int().argmax(0)  # the first rank holding the row's best
    return indices.gather(0, rank.unsqueeze(0)).squeeze(0)


def greedy_tokens(local_logits: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """torch.argmax(full_logits, -1) [T] from this rank's logits [T, its slice of vocab_size];
    every rank gets the same tokens."""
    index = local_logits.argmax(-1)
    value = local_logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    start = tp.bounds(vocab_size)[0]
    values = torch.stack(tp.all_gather(value))
    indices = torch.stack(tp.all_gather(index + start))
    return first_best(values, indices)


def gather_logits(local_logits: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """The full logits [T, vocab_size] on every rank (slices padded to one width to gather)."""
    width = -(-vocab_size // tp.world_size)
    padded = local_logits.new_zeros(local_logits.shape[0], width)
    padded[:, : local_logits.shape[1]] = local_logits
    parts = tp.all_gather(padded)
    bounds = (slice_bounds(vocab_size, rank, tp.world_size) for rank in range(tp.world_size))
    return torch.cat(
        [part[:, : end - start] for part, (start, end) in zip(parts, bounds, strict=True)], -1
    )
