"""Each decoding row's verify width within a step (issue 46): the step's width W comes from the
batch (width_policy.py: measured step costs, the batch's acceptance, probes, dormancy), and each
row then verifies at the width its own acceptance earns, at most W. A row the drafter knows
verifies W rows while one it does not decodes at width 1, in the same step, which then costs
the rows it has (the runner's graphs are keyed by requests and rows).

A row's acceptance per draft position is its own rounds' (halved every ROW_HALF_LIFE of them,
as the batch's are every HALF_LIFE), with the batch's estimate as a prior worth
ROW_PRIOR_WEIGHT rounds: a row not yet verified takes the batch's width. Its width is the one
with the most expected tokens per millisecond at the bucket's measured step costs, as if every
row were like it, less the draft's forward at the drafting widths (a step that drafts runs it
for every decoding row, whatever each verifies). A row held at width 1 for ROW_PROBE_EVERY
drafting steps verifies the narrowest drafting width once (one row more: a drafter that turned
good for it is taken up), its old rounds halved first. All of it on arrays over the slots: a
step at batch 256 costs the host some microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

ROW_PRIOR_WEIGHT = 2.0  # rounds the batch's acceptance is worth in a row's estimate
# A row's rounds are halved every ROW_HALF_LIFE of them: its estimate rests on its last 16-32,
# enough to tell a row that is never right (a few misses) from one right half the time.
ROW_HALF_LIFE = 16
ROW_PROBE_EVERY = 32  # drafting steps a row stays at width 1 before it verifies again


class RowAcceptance:
    """Per slot: rounds that accepted / verified draft j (given 1 .. j-1), since its request
    took the slot."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        positions = max(block_size - 1, 1)
        self.hits = np.zeros((num_slots, positions))
        self.trials = np.zeros((num_slots, positions))
        self.rounds = np.zeros(num_slots, dtype=np.int64)  # since the last halving
        self.held = np.zeros(num_slots, dtype=np.int64)  # drafting steps at width 1 in a row
        self._running: set[int] = set()

    def follow(self, slots: Sequence[int]) -> None:
        """The slots running now: one that was not at the last call took a new request
        (a freed slot is absent from at least one call), of which nothing is known. Kept on
        the host, from the scheduler's slots: no device read."""
        new = [s for s in slots if s not in self._running]
        self._running = set(slots)
        if new:
            index = np.asarray(new, dtype=np.int64)
            self.hits[index] = self.trials[index] = 0
            self.rounds[index] = self.held[index] = 0

    def record(self, slot: int, width: int, accepted: int) -> None:
        """A verify of `width` rows of the request in `slot` accepted `accepted` drafts."""
        if width <= 1:
            return
        self.rounds[slot] += 1
        if self.rounds[slot] >= ROW_HALF_LIFE:
            self.hits[slot] /= 2
            self.trials[slot] /= 2
            self.rounds[slot] = 0
        verified = min(accepted + 1, width - 1)
        self.trials[slot, :verified] += 1
        self.hits[slot, :accepted] += 1

    def accept(self, slots: np.ndarray, batch: Sequence[float]) -> np.ndarray:
        """[rows, B-1]: each row's chance per draft position, the batch's as its prior."""
        prior = np.asarray(batch)[None, :] * ROW_PRIOR_WEIGHT
        return (self.hits[slots] + prior) / (self.trials[slots] + ROW_PRIOR_WEIGHT)

    def widths(
        self,
        slots: Sequence[int],
        step_width: int,
        batch_accept: Sequence[float],
        costs: Mapping[int, float],
    ) -> dict[int, int]:
        """Each slot's width in a step of `step_width` (> 1): the best of `costs` (width -> ms
        of a step, the draft's forward left out; the widths measured in the bucket, none over
        step_width) for its own acceptance, or step_width where step_width has no cost yet."""
        index = np.asarray(slots, dtype=np.int64)
        if step_width not in costs:
            return dict.fromkeys(slots, step_width)
        candidates = sorted(costs)
        accept = self.accept(index, batch_accept)
        # expected_tokens(accept_r, w) for every row and candidate: 1 + sum_{j<w} p_1 .. p_j
        runs = np.cumprod(accept, axis=1)
        totals = np.concatenate([np.ones((len(index), 1)), 1 + np.cumsum(runs, axis=1)], axis=1)
        tokens = totals[:, [w - 1 for w in candidates]]
        rates = tokens / np.asarray([costs[w] for w in candidates])[None, :]
        chosen = np.asarray(candidates)[np.argmax(rates, axis=1)]  # ties: the narrower
        probe = (chosen == 1) & (self.held[index] + 1 >= ROW_PROBE_EVERY)
        self.held[index] = np.where(chosen == 1, self.held[index] + 1, 0)
        if probe.any():  # verify the narrowest drafting width once, the old rounds halved
            drafting = min((w for w in candidates if w > 1), default=step_width)
            chosen = np.where(probe, drafting, chosen)
            probed = index[probe]
            self.hits[probed] /= 2
            self.trials[probed] /= 2
            self.held[probed] = 0
        return dict(zip(slots, chosen.tolist(), strict=True))
