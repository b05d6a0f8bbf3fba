"""How many drafted tokens a verify round accepts (docs/dflash.md sections 4 and 5).

`post` holds the target's token at every verify row, sampled by the engine's sampler (argmax when
greedy). Draft j is accepted while it equals the target's token at row j-1; the first mismatch
commits the target's token instead. With a one-hot (argmax) proposal this is exact speculative
rejection sampling, so the output is distributed as the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoundTrace:
    """One verify round of one request, recorded when the engine's instruments.rounds is a list."""

    row_index: int
    position: int  # position p of the anchor
    anchor: int
    drafts: list[int]  # d1 .. d_{B-1}
    committed: list[int]  # tokens kept after stop / max_tokens cuts


def accepted_lengths(drafts: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """On the device: drafts [R, B-1], post [R, B] -> accepted drafts per request [R] (the
    length of the leading run of d_j == post[j-1])."""
    matches = (drafts == post[:, :-1]).to(torch.int32)
    return matches.cumprod(dim=1).sum(dim=1)
