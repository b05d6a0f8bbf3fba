"""How many rows a step verifies per request: the width that maximises expected committed
tokens per second for the batch at hand, from measured step costs and running acceptance
estimates. Width 1 is plain decoding (no draft forward); width w verifies the anchor and the
first w-1 of the draft's B-1 proposals. Every width is lossless, so the choice changes speed only.

Verifying B rows per request is compute-bound from a modest batch on, so the best width falls as
the batch grows: a round of width w costs draft(n) + verify(n, w) and commits on average
1 + sum_{j<w} p_1 ... p_j tokens per request, where p_j is the chance that draft j is accepted
once drafts 1 .. j-1 were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PRIOR_ACCEPT = 0.5  # a position's acceptance before any round has verified it
PRIOR_WEIGHT = 4.0  # rounds that prior is worth
COST_SMOOTHING = 0.2  # weight of the newest step time in a cost's running mean
PROBE_EVERY = 64  # steps at width 1 between two steps at full width: acceptance keeps its data
SWITCH_MARGIN = 0.05  # a width must promise this much more than the current one to replace it


def candidate_widths(block_size: int) -> tuple[int, ...]:
    """1, the powers of two below B, and B: each needs its own CUDA graphs."""
    widths = {1, block_size}
    w = 2
    while w < block_size:
        widths.add(w)
        w *= 2
    return tuple(sorted(widths))


def expected_tokens(accept: Sequence[float], width: int) -> float:
    """Tokens a round of `width` commits per request on average (accept[j-1] = p_j)."""
    total, run = 1.0, 1.0
    for p in accept[: width - 1]:
        run *= p
        total += run
    return total


def best_width(
    accept: Sequence[float], costs: Mapping[int, float], current: int | None = None
) -> int:
    """The width with the most expected tokens per millisecond; costs: width -> ms of a step
    (draft included) at the current batch size. Ties go to the narrower width; the `current`
    width stays unless another promises SWITCH_MARGIN more (measured costs are noisy, and
    flapping between widths costs context writes)."""

    def rate(w: int) -> float:
        return expected_tokens(accept, w) / costs[w]

    best = max(sorted(costs), key=lambda w: (rate(w), -w))
    if (
        current is not None
        and current in costs
        and rate(best) < rate(current) * (1 + SWITCH_MARGIN)
    ):
        return current
    return best


class WidthPolicy:
    """Running acceptance per draft position and step cost per (width, batch size bucket);
    `choose` measures every width once per bucket, then picks the best."""

    def __init__(self, block_size: int, widths: Sequence[int]) -> None:
        self.widths = tuple(widths)
        self.hits = [0] * (block_size - 1)  # rounds that accepted draft j, given 1 .. j-1
        self.trials = [0] * (block_size - 1)  # rounds that verified draft j, given 1 .. j-1
        self.costs: dict[tuple[int, int], float] = {}
        self._chosen: dict[int, int] = {}  # bucket -> its width now
        self._narrow_steps = 0

    def accept(self) -> list[float]:
        return [
            (h + PRIOR_ACCEPT * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)
            for h, t in zip(self.hits, self.trials, strict=True)
        ]

    def choose(self, bucket: int) -> int:
        unmeasured = [w for w in self.widths if (w, bucket) not in self.costs]
        if unmeasured:
            return unmeasured[-1]
        costs = {w: self.costs[w, bucket] for w in self.widths}
        width = best_width(self.accept(), costs, self._chosen.get(bucket))
        self._chosen[bucket] = width
        self._narrow_steps = self._narrow_steps + 1 if width == 1 else 0
        if self._narrow_steps > PROBE_EVERY:
            self._narrow_steps = 0
            return self.widths[-1]
        return width

    def record_round(self, width: int, accepted: int) -> None:
        """A verify of `width` rows accepted `accepted` drafts."""
        for j in range(min(accepted + 1, width - 1)):
            self.trials[j] += 1
            self.hits[j] += j < accepted

    def record_cost(self, width: int, bucket: int, ms: float) -> None:
        old = self.costs.get((width, bucket))
        self.costs[width, bucket] = ms if old is None else old + COST_SMOOTHING * (ms - old)
