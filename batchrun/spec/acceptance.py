"""How many drafted tokens a verify round accepts (dflash.md sections 4 and 5).

`post` holds the target's token at every verify row, sampled by the engine's sampler (argmax when
greedy). Draft j is accepted while it equals the target's token at row j-1; the first mismatch
commits the target's token instead. With a one-hot (argmax) proposal this is exact speculative
rejection sampling, so the output is distributed as the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundTrace:
    """One verify round of one request, recorded when the engine's round_trace is a list."""

    row_index: int
    position: int  # position p of the anchor
    anchor: int
    drafts: list[int]  # d1 .. d_{B-1}
    committed: list[int]  # tokens kept after stop / max_tokens cuts


def accepted_count(drafts: list[int], post: list[int]) -> int:
    """Number of leading drafts d_j (j = 1..B-1) with d_j == post[j-1]."""
    n = 0
    for draft, target in zip(drafts, post, strict=False):
        if draft != target:
            break
        n += 1
    return n
