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

from collections import deque
from collections.abc import Mapping, Sequence

PRIOR_ACCEPT = 0.5  # a position's acceptance before any round has verified it
PRIOR_WEIGHT = 4.0  # rounds that prior is worth
MIN_SAMPLES = 3  # step times a width needs in a bucket before it is compared
RECENT_SAMPLES = 8  # a cost is the least of this many newest step times
REMEASURE_EVERY = 512  # steps after which a width not run since is measured again
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
    """Running acceptance per draft position and step cost per (width, batch size bucket).
    `choose` measures the widths of a bucket (MIN_SAMPLES steps each), then picks the best;
    a width left unrun for REMEASURE_EVERY steps is measured again, so one unlucky sample
    cannot rule it out for the rest of the job (and wide rounds keep feeding acceptance when
    width 1 wins). The engine drops the time of a step whose width differs from the step
    before: a switch costs the pipeline more than the width does.

    Measuring a narrow width in a short job costs the tokens a wide one would have committed,
    so a bucket skips the widths that cannot win: the widest is measured first, then width 1
    (the cheapest step there is, so a lower bound on every width's cost), and a width runs only
    if its expected tokens at width 1's cost beat the best measured rate. The best width also
    falls as the batch grows (wide verifies turn compute-bound first), so a bucket only
    considers widths between the choices of the nearest larger and smaller buckets chosen."""

    def __init__(self, block_size: int, widths: Sequence[int]) -> None:
        self.widths = tuple(widths)
        self.hits = [0] * (block_size - 1)  # rounds that accepted draft j, given 1 .. j-1
        self.trials = [0] * (block_size - 1)  # rounds that verified draft j, given 1 .. j-1
        self.samples: dict[tuple[int, int], deque[float]] = {}  # newest step times, in ms
        self._measured_at: dict[tuple[int, int], int] = {}  # the step of the newest sample
        self._chosen: dict[int, int] = {}  # bucket -> its width now
        self._step = 0

    def accept(self) -> list[float]:
        return [
            (h + PRIOR_ACCEPT * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)
            for h, t in zip(self.hits, self.trials, strict=True)
        ]

    def cost(self, width: int, bucket: int) -> float | None:
        """Milliseconds of a step at `width` in `bucket` (None: not measured enough): the least
        recent step time, as the host's hiccups (a collection, a part written, a graph's first
        replay) only ever add time."""
        times = self.samples.get((width, bucket), ())
        return min(times) if len(times) >= MIN_SAMPLES else None

    def choose(self, bucket: int) -> int:
        self._step += 1
        for w in self.widths:  # stale: forget it, so that it is measured afresh below
            at = self._measured_at.get((w, bucket))
            if at is not None and self._step - at > REMEASURE_EVERY:
                del self.samples[w, bucket], self._measured_at[w, bucket]
        widths = self._widths_for(bucket)
        accept = self.accept()
        known = {w: c for w in widths if (c := self.cost(w, bucket)) is not None}
        best_rate = max((expected_tokens(accept, w) / c for w, c in known.items()), default=0.0)
        floor = known.get(1) if widths[0] == 1 else None  # no step is cheaper than width 1's
        for w in (widths[-1], *widths[:1], *widths[-2:0:-1]):  # widest, 1, then wide to narrow
            if w not in known and (floor is None or expected_tokens(accept, w) / floor > best_rate):
                return w
        width = best_width(accept, known, self._chosen.get(bucket))
        self._chosen[bucket] = width
        return width

    def _widths_for(self, bucket: int) -> tuple[int, ...]:
        """The widths between the choices of the nearest larger and smaller chosen buckets
        (all of them where those disagree with the rule that the best width falls with the
        batch: noise in one bucket must not lock another out)."""
        larger = [w for b, w in self._chosen.items() if b > bucket]
        smaller = [w for b, w in self._chosen.items() if b < bucket]
        low, high = max(larger, default=1), min(smaller, default=self.widths[-1])
        inside = tuple(w for w in self.widths if low <= w <= high)
        return inside or self.widths

    def record_round(self, width: int, accepted: int) -> None:
        """A verify of `width` rows accepted `accepted` drafts."""
        for j in range(min(accepted + 1, width - 1)):
            self.trials[j] += 1
            self.hits[j] += j < accepted

    def record_cost(self, width: int, bucket: int, ms: float) -> None:
        key = (width, bucket)
        self.samples.setdefault(key, deque(maxlen=RECENT_SAMPLES)).append(ms)
        self._measured_at[key] = self._step
