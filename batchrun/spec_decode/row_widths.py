"""Each decoding row's verify width within a step: the step's width W comes from the
batch (width_policy.py: measured step costs, the batch's acceptance, probes, dormancy), and each
row then verifies at W, or at width 1 when its own acceptance says its drafts earn under
ROW_MIN_GAIN of what the batch's do at W. A row the drafter knows verifies W rows while one it
does not decodes, in the same step, which then costs the rows it has (the runner's graphs are
keyed by requests and rows); the batch's acceptance is then learnt from the rows that verify, and
the costs W is chosen by are those of such steps.

A row's acceptance per draft position is its own rounds' (halved every ROW_HALF_LIFE of them, as
the batch's are every HALF_LIFE), with the batch's estimate as a prior worth ROW_PRIOR_WEIGHT
rounds: a row not yet verified takes W, and one the drafter never gets right drops to width 1
after a few rounds. A row held at width 1 for ROW_PROBE_EVERY drafting steps verifies the
narrowest drafting width once (one row more in a step that drafts anyway: a drafter that turned
good for it is taken up), its old rounds halved first; every row's rounds are forgotten when the
batch's are (WidthPolicy.relearn). The speculator trims no row while the batch probes an unknown
drafter (the probe would never end) nor a row running alone (it is the batch). All of it on
arrays over the slots: a step at batch 256 costs the host some microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROW_PRIOR_WEIGHT = 1.0  # rounds the batch's acceptance is worth in a row's estimate
# A row whose expected accepted drafts at W fall under this share of the batch's decodes: after
# 4 misses in a row (prior weight 1) a row is under a fifth of the batch's.
ROW_MIN_GAIN = 0.25
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
        self._relearned = 0  # the batch policy's relearn count these rounds were kept under

    def follow(self, slots: Sequence[int], relearned: int) -> None:
        """The slots running now: one that was not at the last call took a new request
        (a freed slot is absent from at least one call), of which nothing is known. Kept on
        the host, from the scheduler's slots: no device read. relearned: how often the batch's
        acceptance was forgotten (width_policy.py's relearn: a probe, rows turned over); each
        row's is forgotten with it, so a row held at width 1 is probed with the batch."""
        if relearned != self._relearned:
            self._relearned = relearned
            self.hits[:] = self.trials[:] = 0
            self.rounds[:] = self.held[:] = 0
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
        probe_width: int,
    ) -> dict[int, int]:
        """Each slot's width in a step of `step_width` (> 1): step_width, or 1 for a row whose
        drafts earn under ROW_MIN_GAIN of what the batch's do there (a row held at 1 for
        ROW_PROBE_EVERY drafting steps verifies `probe_width` once)."""
        index = np.asarray(slots, dtype=np.int64)
        accept = self.accept(index, batch_accept)[:, : step_width - 1]
        gains = np.cumprod(accept, axis=1).sum(axis=1)  # expected_tokens(row, W) - 1
        batch_gain = float(np.cumprod(np.asarray(batch_accept)[: step_width - 1]).sum())
        kept = gains >= ROW_MIN_GAIN * batch_gain
        chosen = np.where(kept, step_width, 1)
        probe = ~kept & (self.held[index] + 1 >= ROW_PROBE_EVERY)
        self.held[index] = np.where(kept, 0, self.held[index] + 1)
        if probe.any():  # verify the narrowest drafting width once, the old rounds halved
            chosen = np.where(probe, min(probe_width, step_width), chosen)
            probed = index[probe]
            self.hits[probed] /= 2
            self.trials[probed] /= 2
            self.held[probed] = 0
        return dict(zip(slots, chosen.tolist(), strict=True))
