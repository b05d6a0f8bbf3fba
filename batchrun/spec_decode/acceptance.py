"""How many drafted tokens a verify round accepts (docs/dflash.md sections 4 and 5).

`post` holds the target's token at every verify row, sampled by the engine's sampler (argmax when
greedy). Draft j is accepted while it equals the target's token at row j-1; the first mismatch
commits the target's token instead. With a one-hot (argmax) proposal this is exact speculative
rejection sampling, so the output is distributed as the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.attention.meta import padded_rows


@dataclass(frozen=True)
class RoundTrace:
    """One verify round of one request, recorded when the engine's instruments.rounds is a list."""

    row_index: int
    position: int  # position p of the anchor
    anchor: int
    drafts: list[int]  # d1 .. d_{B-1}
    committed: list[int]  # tokens kept after stop / max_tokens cuts


def accepted_lengths(
    drafts: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor
) -> torch.Tensor:
    """On the device: drafts [R, B-1]; tokens: the target's, request r's W_r = widths[r] of
    them from starts[r] (its verify rows, packed by offsets) -> accepted drafts per request
    [R]: the length of the leading run of d_j == post[j-1] among its W_r - 1 verified drafts."""
    grid, _ = padded_rows(starts, widths, drafts.shape[1])
    verified = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < widths[:, None] - 1
    matches = ((drafts == tokens[grid]) & verified).to(torch.int32)
    return matches.cumprod(dim=1).sum(dim=1)
