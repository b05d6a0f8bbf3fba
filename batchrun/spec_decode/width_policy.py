"""How many rows a step verifies per request: the width that maximises expected committed
tokens per second for the batch at hand, from measured step costs and running acceptance
estimates. Width 1 is plain decoding (no draft forward); width w verifies the anchor and the
first w-1 of the draft's B-1 proposals. Every width is lossless, so the choice changes speed only.

Verifying B rows per request is compute-bound from a modest batch on, so the best width falls as
the batch grows: a round of width w costs draft(n) + verify(n, w) and commits on average
1 + sum_{j<w} p_1 ... p_j tokens per request, where p_j is the chance that draft j is accepted
once drafts 1 .. j-1 were. On a hybrid target (Gated DeltaNet layers) verify(n, w) includes the
commit's replay of the kept rows through the linear layers (engine/linear_slots.py), which runs
in the same step on the device: the measured step times already hold it, so no term is added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

PRIOR_ACCEPT = 0.5  # a position's acceptance before any round has verified it
PRIOR_WEIGHT = 1.0  # rounds that prior is worth
MIN_SAMPLES = 3  # step times a width needs in a bucket before it is compared
RECENT_SAMPLES = 8  # a cost is the least of this many newest step times
REMEASURE_EVERY = 512  # steps after which a width not run since is measured again
SWITCH_MARGIN = 0.05  # a width must promise this much more than the current one to replace it
CHOICE_DRIFT = 0.2  # see WidthPolicy._widths_for
COMPUTE_ROWS = 1024  # a step of this many rows or more times the matmuls' rate per row
# Acceptance is forgotten by rounds: every HALF_LIFE rounds recorded, all positions' hits and
# trials are halved, so an estimate rests on the last 1-2 x HALF_LIFE rounds. 64 keeps at least
# 64 rounds behind position 1 (a standard error <= 0.5/sqrt(64) = 0.06 on a probability); at 32
# that noise already picks wrong widths on jobs of constant acceptance. A drafter that turns
# useless has p_1's hits halved every HALF_LIFE rounds, so 6 halvings (384 rounds) take it from
# 0.9 below the ~0.03 at which width 1 wins even where a wide verify is cheapest (batch 1): 384
# steps at batch 1, 12 at batch 32. Positions no round reaches decay towards the prior.
HALF_LIFE = 64
# Width 1 records no rounds, so a drafter held there is re-learned from scratch (its counts
# cleared, so the narrowest drafting width probes it again, as at the start) once the time spent
# since its last round is PROBE_EVERY times what the probe costs over width-1 steps (in the
# bucket at hand, measured): the probes take at most 1% of the job at any batch size, and a
# drafter that turned good is taken up within about 100 probe costs (some 200 steps at batch 1
# on an H200, 170 at batch 128). A probe is PROBE_ROUNDS rounds (one step from batch 8 on): one
# round's miss leaves the later positions at the prior, which at batch 1 makes the whole block
# look worth verifying; a probe that sees a draft accepted ends there, and no step is launched
# to probe while enough rounds to end it are in flight (the engine launches the next step
# before it reads the last back: on the CPU demo that second step doubled a probe's cost).
# Before the draft's time is measured, a probe step is guessed to cost PROBE_GUESS of a step
# more (an H200's width 2 at batch 1 to 8, the least at any batch: it errs towards probing early).
# A batch whose rows have turned over since the newest round (as many admitted since as are
# running) is re-learned too, at once: the estimate describes rows that have left. At batch 1
# that is each new row at width 1, the rows a drafter knows and those it does not taking turns
# (without it 0.89x of the full block there; it costs a useless drafter one probe a row).
PROBE_EVERY = 100
PROBE_ROUNDS = 8
PROBE_GUESS = 0.25
# A drafter the policy has kept at width 1 for this many measured steps in a row, because it
# accepts too little or costs too much at this batch, goes dormant: width-1 steps stop capturing
# features and writing its context, so a drafter that loses costs what no drafter does. The
# writes cost 1.6% of a step at batch 128 on an H200, 2.1% at batch 1 on an H100 (6.90 against
# 6.76 ms, bench/results/jobs-h100-w2-b1-policy-warm.json) and 5% on the CPU demo: at every
# batch size more than the holes they spare a drafter that wakes on the same rows. 16 steps:
# past the noise of a single unlucky choice, a small share of any job. Prompts are written still
# (a step with prefill chunks is not quiet), so every row's holes are in its output. When
# PROBE_EVERY comes round it is probed at once, holes and all: on the demo pair those rounds
# accept about 70% of what rows without holes do, and the gap closes within some 20 rounds of
# writes. A probe that saw nothing accepted sends it back to sleep at once (16 steps of writes
# per probe cost the CPU demo 0.7% of its job).
DORMANT_AFTER = 16


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


def step_tokens(accept: Sequence[float], width: int, share: float = 1.0) -> float:
    """Tokens a step of `width` commits per request when `share` of its rows verify at that
    width and the rest decode (row_widths.py): the drafts only the share's rows earn."""
    if width == 1:
        return 1.0
    return 1.0 + share * (expected_tokens(accept, width) - 1.0)


def best_width(
    accept: Sequence[float],
    costs: Mapping[int, float],
    current: int | None = None,
    share: float = 1.0,
) -> int:
    """The width with the most expected tokens per millisecond; costs: width -> ms of a step
    (draft included) at the current batch size. Ties go to the narrower width; the `current`
    width stays unless another promises SWITCH_MARGIN more (measured costs are noisy, and
    flapping between widths costs context writes)."""

    def rate(w: int) -> float:
        return step_tokens(accept, w, share) / costs[w]

    best = max(sorted(costs), key=lambda w: (rate(w), -w))
    if (
        current is not None
        and current in costs
        and rate(best) < rate(current) * (1 + SWITCH_MARGIN)
    ):
        return current
    return best


def best_rate(accept: Sequence[float], costs: Mapping[int, float], share: float = 1.0) -> float:
    """The most tokens per request per millisecond among the widths of `costs` (0.0: none)."""
    return max((step_tokens(accept, w, share) / c for w, c in costs.items()), default=0.0)


def step_width(
    policy: WidthPolicy,
    *,
    bucket: int,
    running: int,
    prefill_pending: bool,
    max_batched_tokens: int,
) -> int:
    """The policy's width for the engine's next step, over `running` requests (whose batch-size
    bucket is `bucket`): measured only in a step of decode rows alone, and no wider than the
    token budget holds."""
    running = max(running, 1)
    if prefill_pending:
        return policy.mixed_width(bucket, max_width=max_batched_tokens // running, requests=running)
    return policy.choose(bucket, max_width=max_batched_tokens // running, requests=running)


class WidthPolicy:
    """Running acceptance per draft position and step cost per (width, batch size bucket).

    A bucket measures its widths (MIN_SAMPLES steps each), then picks the best. Measuring costs
    the tokens (or the time) the best width would have given, so a width is measured only if
    it could still win, judged with two facts that need no measurement of it: a wider step never
    costs less than a narrower one measured in the bucket (it does the same work and more), and
    a round of width w commits at most expected_tokens(accept, w). The order follows: width 1
    first (the cheapest step, no draft forward), then, while the drafter's acceptance is
    unknown, the narrowest drafting width (the cheapest way to learn it: a drafter that accepts
    nothing is then ruled out for every width at once), then the widest that could win, down.
    A width left unrun for REMEASURE_EVERY steps is forgotten, so one unlucky sample cannot rule
    it out for the whole job; it is measured again only if it could win. Acceptance is
    forgotten too (HALF_LIFE, PROBE_EVERY), so the width follows a drafter that changes.

    A third fact bounds a wide step's cost from below before it ever runs: its rows' matmuls,
    at the least time per row that a step of COMPUTE_ROWS rows or more has taken (prefill
    chunks show it early), so a verify that turns compute-bound is ruled out unmeasured.

    Only steps in which every request decodes measure a width. The other steps (prefill chunks
    mixed in) are compute-bound: there a verify row costs what a prefill row does, and a width
    drafts only where its drafts earn more than that time would in decode steps (mixed_width).
    The engine drops the time of a step whose width differs from the step before: a switch
    costs the pipeline more than the width does. The best width also falls as the batch grows (wide
    verifies turn compute-bound first), so a bucket only considers widths between the choices
    of the nearest larger and smaller buckets chosen."""

    def __init__(self, block_size: int, widths: Sequence[int]) -> None:
        self.widths = tuple(widths)
        # Rounds (halved every HALF_LIFE of them) that accepted / verified draft j, given 1 .. j-1.
        self.hits: list[float] = [0] * (block_size - 1)
        self.trials: list[float] = [0] * (block_size - 1)
        self._rounds = 0  # rounds recorded since the last halving
        self._since_round_ms = 0.0  # step time since the newest round
        self.samples: dict[tuple[int, int], deque[float]] = {}  # newest step times, in ms
        self._measured_at: dict[tuple[int, int], int] = {}  # the step of the newest sample
        # bucket -> its width now, and the block's expected tokens a round when it was chosen
        self._chosen: dict[int, tuple[int, float]] = {}
        self._step = 0
        self._ms_per_row: deque[float] = deque(maxlen=RECENT_SAMPLES)  # of compute-bound steps
        self._recent_ms: deque[float] = deque(maxlen=RECENT_SAMPLES)  # any step's
        self._draft_ms: dict[int, deque[float]] = {}  # bucket -> the draft's newest own times
        self._ones = 0  # measured steps in a row at width 1 after the drafter was tried
        self._probing = 0  # rounds launched to probe the drafter, not yet recorded
        self._probed_at = 0  # the step that launched the newest of them
        self._fresh = 0  # requests admitted since the newest round
        # The share of the decoding rows that verify at the step's width when it drafts (the
        # rest decode: row_widths.py), as the last drafting step had it: a width is judged by
        # the tokens the step commits, not those of a row that verifies.
        self.row_share = 1.0
        self.relearned = 0  # times relearn ran: each row's own acceptance is forgotten with it

    @property
    def dormant(self) -> bool:
        """Width 1 was chosen for DORMANT_AFTER measured steps in a row: context unwritten."""
        return self._ones >= DORMANT_AFTER

    @property
    def writes_context(self) -> bool:
        """Whether the draft's context is written (width-1 steps capture features for it)."""
        return not self.dormant

    @property
    def probing(self) -> bool:
        """The drafter is unknown (fewer than PROBE_ROUNDS rounds, none accepted): a drafting
        step probes it, every row at its width (row_widths.py trims none)."""
        return self.trials[0] < PROBE_ROUNDS and not self.hits[0]

    def relearn(self) -> None:
        """Forget the acceptance and the choices made from it: the narrowest drafting width
        probes the drafter again (as at the start), every row at it (row_widths.py)."""
        self.hits = [0] * len(self.hits)
        self.trials = [0] * len(self.trials)
        self._rounds = 0
        self.relearned += 1
        self.row_share = 1.0
        self._chosen.clear()
        self._ones = 0
        self._probing = 0

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

    def _least(self, width: int, bucket: int) -> float:
        """The least step time seen at `width` in `bucket`, however few (0.0: none)."""
        return min(self.samples.get((width, bucket)) or [0.0])

    def choose(
        self,
        bucket: int,
        *,
        max_width: int | None = None,
        requests: int | None = None,
    ) -> int:
        """The width of the next step, in which every request decodes (a step with prefill
        chunks: mixed_width); max_width: the widest whose rows fit the step's token budget;
        requests: how many decode in it (default: the bucket's size)."""
        self._step += 1
        probe_ms = self._probe_ms(bucket, requests or bucket)
        stale = self._since_round_ms > PROBE_EVERY * probe_ms
        if any(self.trials) and (stale or self._fresh >= (requests or bucket)):
            # Too old to tell what the drafter does now, or measured on rows that have left
            # (as many admitted since as are running): so are the choices made from them.
            self.relearn()
        fits = [w for w in self.widths if max_width is None or w <= max_width] or [1]
        for w in self.widths:  # stale: forget it, so that it may be measured afresh below
            at = self._measured_at.get((w, bucket))
            if at is not None and self._step - at > REMEASURE_EVERY:
                del self.samples[w, bucket], self._measured_at[w, bucket]
        accept = self.accept()
        block_tokens = expected_tokens(accept, self.widths[-1])
        widths = [w for w in self._widths_for(bucket, block_tokens) if w in fits] or fits
        known = self._measured(widths, bucket)
        width = self._to_measure(widths, known, accept, bucket, requests or bucket)
        if width is None:
            current = self._chosen.get(bucket, (None, 0.0))[0]
            width = best_width(accept, known, current, self.row_share)
            self._chosen[bucket] = (width, block_tokens)
        held = width == 1 and any(self.trials)
        self._ones = self._ones + 1 if held else 0
        if held and self.trials[0] >= PROBE_ROUNDS and not self.hits[0]:
            self._ones = DORMANT_AFTER  # a probe saw nothing accepted: back to sleep at once
        return width

    def mixed_width(self, bucket: int, *, max_width: int, requests: int) -> int:
        """The width of a step with prefill chunks (compute-bound: measured by no width). Its
        `requests` decoding rows verify at width w > 1 only where their drafts' expected tokens
        beat what the time they add, requests * (w - 1) rows at the compute-bound rate per row
        plus the draft's forward, commits in the bucket's best decode steps: on an H100 a
        width-16 verify added ~12% to W2's mixed steps and committed ~5 tokens a row more
        (bench/results/jobs-h100-w1-w2-b1-policy.json). Width 1 until the drafter is known,
        both rates are measured and the drafter is awake (a probe or a dormant drafter's holes
        are for decode steps to settle)."""
        self._step += 1
        ms_per_row = min(self._ms_per_row, default=0.0)
        draft = self._draft_least(bucket)
        accept, share = self.accept(), self.row_share
        known = self._measured(self.widths, bucket)
        if self.probing or self.dormant or not any(self.trials) or not ms_per_row or not known:
            return 1
        decode_rate = best_rate(accept, known, share)

        def net(w: int) -> float:  # tokens per request beyond what the time buys in decode
            added = requests * (w - 1) * ms_per_row + draft
            return step_tokens(accept, w, share) - 1.0 - decode_rate * added

        drafting = [w for w in self.widths if 1 < w <= max_width]
        best = max(drafting, key=net, default=1)
        return best if best > 1 and net(best) > 0 else 1

    def _measured(self, widths: Sequence[int], bucket: int) -> dict[int, float]:
        """width -> cost of those of `widths` measured enough in `bucket`."""
        return {w: c for w in widths if (c := self.cost(w, bucket)) is not None}

    def _probe_ms(self, bucket: int, requests: int) -> float:
        """What a probe (PROBE_ROUNDS rounds at the narrowest drafting width) costs over as many
        width-1 steps, here: at least the draft's own forward a step, and what a step of that
        width took over a width-1 one where both were timed (a probe step follows a switch, so
        its own time is seldom kept)."""
        steps = -(-PROBE_ROUNDS // max(requests, 1))
        drafting = [w for w in self.widths if w > 1]
        one = self._least(1, bucket)
        probe = self._least(drafting[0], bucket) if drafting else 0.0
        extra = max(probe - one if one and probe else 0.0, self._draft_newest(bucket))
        if extra:
            return steps * extra
        step = one or min(self._recent_ms, default=0.0)
        return steps * PROBE_GUESS * step if step else float("inf")

    def _to_measure(
        self,
        widths: list[int],
        known: dict[int, float],
        accept: list[float],
        bucket: int,
        requests: int,
    ) -> int | None:
        """The next width this bucket measures, or None when none could win."""
        if widths[0] not in known and widths[0] == 1:
            return 1
        drafting = [w for w in widths if w > 1]
        if drafting and self.probing:
            # The drafter is unknown: learn its acceptance cheaply (the cheapest width while
            # the rounds in flight will do).
            if self._probe_in_flight():
                return widths[0]
            self._probing += requests
            self._probed_at = self._step
            return drafting[0]
        share = self.row_share
        best = best_rate(accept, known, share)
        for w in reversed(widths):
            if w in known:
                continue
            # Its own first samples, if any: a hiccup only adds time, so no more than halves a
            # step; a width that loses even at half its least sample is not run again.
            floor = max(self._floor(w, bucket, requests), self._least(w, bucket) / 2)
            if not floor or step_tokens(accept, w, share) / floor > best * (1 + SWITCH_MARGIN):
                return w
        return None

    def _probe_in_flight(self) -> bool:
        """Whether the probe rounds launched and not yet read back will end the probe. A step
        is read back before the one after the next is launched: rounds launched longer ago that
        were never recorded (their requests left the step) are not waited for."""
        in_flight = self._probing if self._step - self._probed_at <= 2 else 0
        return self.trials[0] + in_flight >= PROBE_ROUNDS

    def _floor(self, width: int, bucket: int, requests: int) -> float:
        """The least a step of `width` can cost here now, its own samples aside: what a
        narrower width costs (one sample will do), its rows' matmuls, and at a drafting width
        the draft's own forward and a verify, which costs at least a width-1 step."""
        floor = max((self._least(v, bucket) for v in self.widths if v < width), default=0.0)
        floor = max(floor, requests * width * min(self._ms_per_row, default=0.0))
        if width > 1 and (draft := self._draft_least(bucket)):
            floor = max(floor, draft + self._least(1, bucket))
        return floor

    def _widths_for(self, bucket: int, block_tokens: float) -> tuple[int, ...]:
        """The widths between the choices of the larger and smaller buckets (all of them where
        those disagree with the rule that the best width falls with the batch: noise in one
        bucket must not lock another out). The rule holds for one acceptance: a choice made
        when the block's expected tokens differed by more than CHOICE_DRIFT from now bounds
        nothing (the rows that drafted well there may be gone)."""
        near = {
            b: w
            for b, (w, tokens) in self._chosen.items()
            if abs(tokens - block_tokens) <= CHOICE_DRIFT * block_tokens
        }
        larger = [w for b, w in near.items() if b > bucket]
        smaller = [w for b, w in near.items() if b < bucket]
        low, high = max(larger, default=1), min(smaller, default=self.widths[-1])
        inside = tuple(w for w in self.widths if low <= w <= high)
        return inside or self.widths

    def record_round(self, width: int, accepted: int) -> None:
        """A verify of `width` rows accepted `accepted` drafts."""
        self._since_round_ms, self._rounds = 0.0, self._rounds + 1
        self._probing = max(self._probing - 1, 0)
        self._fresh = 0
        if self._rounds >= HALF_LIFE:
            self.hits = [h / 2 for h in self.hits]
            self.trials = [t / 2 for t in self.trials]
            self._rounds = 0
        for j in range(min(accepted + 1, width - 1)):
            self.trials[j] += 1
            self.hits[j] += j < accepted

    def record_admitted(self, requests: int) -> None:
        """Requests that joined the batch (their rows may draft unlike those measured)."""
        self._fresh += requests

    def record_rows(self, rows: int, ms: float) -> None:
        """A step's rows and time, timed alone (a compute-bound one's tell the matmuls' rate)."""
        if rows >= COMPUTE_ROWS:
            self._ms_per_row.append(ms / rows)

    def record_elapsed(self, ms: float) -> None:
        """Every step's time, switches included: the clock of the probes."""
        self._since_round_ms += ms
        self._recent_ms.append(ms)

    def record_draft(self, bucket: int, ms: float) -> None:
        """The draft's own time in a step of `bucket` (draft_clock.py)."""
        self._draft_ms.setdefault(bucket, deque(maxlen=RECENT_SAMPLES)).append(ms)

    def _draft_newest(self, bucket: int) -> float:
        """The draft's newest time here: its forward grows with the rows' context, so a
        probe's cost is what it took last, not at the start of the job."""
        times = self._draft_ms.get(bucket)
        return times[-1] if times else 0.0

    def _draft_least(self, bucket: int) -> float:
        return min(self._draft_ms.get(bucket) or [0.0])

    def record_cost(self, width: int, bucket: int, ms: float) -> None:
        key = (width, bucket)
        self.samples.setdefault(key, deque(maxlen=RECENT_SAMPLES)).append(ms)
        self._measured_at[key] = self._step
