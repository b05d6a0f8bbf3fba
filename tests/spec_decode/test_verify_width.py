"""The verify-width policy as a pure function of measured step costs and acceptance."""

from __future__ import annotations

import pytest

from batchrun.spec_decode.width_policy import (
    MIN_SAMPLES,
    PRIOR_ACCEPT,
    PROBE_ROUNDS,
    RECENT_SAMPLES,
    REMEASURE_EVERY,
    WidthPolicy,
    best_width,
    candidate_widths,
    expected_tokens,
    step_width,
)

WIDTHS = (1, 2, 4, 8, 16)


def test_candidates_are_one_the_powers_of_two_and_the_block() -> None:
    assert candidate_widths(16) == WIDTHS
    assert candidate_widths(5) == (1, 2, 4, 5)
    assert candidate_widths(2) == (1, 2)


def test_expected_tokens() -> None:
    assert expected_tokens([0.5] * 15, 1) == 1
    assert expected_tokens([0.5] * 15, 3) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0, 0.0, 1.0], 4) == 2  # nothing past the first rejection
    assert expected_tokens([0.9] * 15, 16) == pytest.approx(sum(0.9**j for j in range(16)))


def test_small_batches_verify_the_block_and_large_ones_decode() -> None:
    accept = [0.9] * 15  # a well-trained draft: about 6.4 tokens a round at B = 16
    # Memory-bound (batch 1): a wider verify costs almost nothing more; the draft is extra.
    small = {1: 5.0, 2: 6.3, 4: 6.35, 8: 6.4, 16: 6.5}
    assert best_width(accept, small) == 16
    # Compute-bound (batch 256): verify cost grows with the rows; a draft forward is dear.
    large = {1: 13.0, 2: 60.0, 4: 75.0, 8: 105.0, 16: 160.0}
    assert best_width(accept, large) == 1
    # In between, a narrower block wins.
    middle = {1: 8.0, 2: 14.0, 4: 16.0, 8: 24.0, 16: 66.0}
    assert best_width(accept, middle) == 8
    # A draft that accepts nothing never pays.
    assert best_width([0.0] * 15, small) == 1


def test_ties_go_to_the_narrower_width() -> None:
    assert best_width([1.0] * 15, {1: 1.0, 2: 2.0}) == 1


def test_the_current_width_stays_unless_another_is_clearly_better() -> None:
    accept = [0.5] * 15
    costs = {1: 1.0, 2: 1.45}  # width 2: 1.5 tokens for 1.45 ms, 3% more than width 1
    assert best_width(accept, costs) == 2
    assert best_width(accept, costs, current=1) == 1
    assert best_width(accept, {1: 1.0, 2: 1.2}, current=1) == 2  # 25% more: switch


def _measure(policy: WidthPolicy, costs: dict[int, float], accepted: int, steps: int) -> list[int]:
    """`steps` steps of bucket 32, each of 32 rounds accepting `accepted` drafts; the widths."""
    seen = []
    for _ in range(steps):
        width = policy.choose(bucket=32)
        seen.append(width)
        policy.record_cost(width, 32, costs[width])
        for _ in range(32 if width > 1 else 0):
            policy.record_round(width, min(accepted, width - 1))
    return seen


COSTS = {1: 5.0, 2: 6.0, 4: 6.1, 8: 6.2, 16: 6.3}


def test_the_policy_measures_the_widths_that_can_win_then_chooses() -> None:
    """Width 1 first (the least a step costs), then one step of the narrowest drafting width
    (the drafter's acceptance, cheaply), then the widest, then narrower ones only while they
    could still win at the cost of a narrower width already measured: width 8 commits 5 tokens
    like width 16 but could save at most 0.3 ms of its 6.3, under the margin."""
    seen = _measure(WidthPolicy(16, WIDTHS), COSTS, accepted=4, steps=12)
    assert seen == [1] * MIN_SAMPLES + [2] + [16] * (12 - MIN_SAMPLES - 1)


def test_a_drafter_that_accepts_nothing_is_ruled_out_after_one_step() -> None:
    """Its one probe step shows the first draft rejected: no width can commit more than width 1
    at a cost no lower than that probe's, so nothing wider is ever run."""
    policy = WidthPolicy(16, WIDTHS)
    seen = _measure(policy, COSTS, accepted=0, steps=40)
    assert seen == [1] * MIN_SAMPLES + [2] + [1] * (40 - MIN_SAMPLES - 1)
    seen = _measure(policy, COSTS, accepted=0, steps=REMEASURE_EVERY + 20)  # stale, still out
    assert set(seen) == {1}


@pytest.mark.parametrize("requests", [1, 3, PROBE_ROUNDS, 48])
def test_a_probe_launches_no_more_rounds_than_it_needs(requests: int) -> None:
    """The engine launches the next step before it reads the last back: while the rounds in
    flight will end the probe, the next step decodes at width 1 (a second probe step doubled
    a probe's cost on the CPU demo). Once they are read back, a drafter that missed them all
    is not probed again."""
    policy, bucket = WidthPolicy(16, WIDTHS), 64
    for _ in range(MIN_SAMPLES):  # width 1 measured first
        assert policy.choose(bucket, requests=requests) == 1
        policy.record_cost(1, bucket, 5.0)
    in_flight: list[int] = []  # each launched step's rounds, read back one step late
    launched = []
    for _ in range(2 * PROBE_ROUNDS + 4):
        width = policy.choose(bucket, requests=requests)
        launched.append(width)
        in_flight.append(requests if width > 1 else 0)
        if width > 1:
            policy.record_draft(bucket, 3.0)  # a draft's forward: more than a wide step gains
        if len(in_flight) > 1:
            for _ in range(in_flight.pop(0)):
                policy.record_round(2, 0)
    probe_steps = -(-PROBE_ROUNDS // requests)
    assert launched[: probe_steps + 1] == [2] * probe_steps + [1]
    assert set(launched[probe_steps:]) == {1}


def test_a_step_with_prefill_drafts_where_its_drafts_pay_for_their_rows() -> None:
    """A step with prefill chunks is compute-bound: its verify rows cost the measured time per
    row, and a width drafts there only if its tokens beat what that time (and the draft's
    forward) commits in the bucket's decode steps. The H100's W2 (32 requests, 0.016 ms a
    prefill row, a 3 ms draft, 12 of 15 drafts accepted) drafts at the full block; a
    compute rate 20x slower, or a drafter accepting nothing, decodes one row per request."""

    def trained(ms_per_row: float, accepted: int) -> WidthPolicy:
        policy = WidthPolicy(16, WIDTHS)
        _measure(policy, {1: 8.7, 2: 11.0, 4: 12.0, 8: 15.8, 16: 19.2}, accepted, steps=16)
        policy.record_draft(32, 3.0)
        policy.record_rows(4096, 4096 * ms_per_row)
        return policy

    assert trained(0.016, accepted=12).mixed_width(32, max_width=128, requests=32) == 16
    assert trained(0.016, accepted=12).mixed_width(32, max_width=8, requests=32) == 8  # budget
    assert trained(0.32, accepted=12).mixed_width(32, max_width=128, requests=32) == 1
    assert trained(0.016, accepted=0).mixed_width(32, max_width=128, requests=32) == 1
    unknown = WidthPolicy(16, WIDTHS)  # nothing measured, nothing accepted yet
    unknown.record_rows(4096, 60.0)
    assert unknown.mixed_width(32, max_width=128, requests=32) == 1


def test_the_step_width_of_a_step_with_prefill_is_the_mixed_width() -> None:
    policy = WidthPolicy(16, WIDTHS)
    _measure(policy, COSTS, accepted=15, steps=12)
    policy.record_rows(4096, 40.0)
    mixed = step_width(policy, bucket=32, running=32, prefill_pending=True, max_batched_tokens=4096)
    assert mixed == policy.mixed_width(32, max_width=128, requests=32) > 1
    assert policy.choose(32, max_width=2) in (1, 2)  # no wider than the token budget holds


def test_a_verify_that_turns_compute_bound_is_ruled_out_unmeasured() -> None:
    """Prefill chunks showed 0.02 ms a row: at 128 requests width 16 costs at least 41 ms, so a
    drafter committing 3 tokens a round cannot win there against width 1's 10 ms; without that
    evidence the widest width is measured."""

    def widths_run(rows_seen: bool) -> list[int]:
        policy = WidthPolicy(16, WIDTHS)
        if rows_seen:
            policy.record_rows(2048, 41.0)
        seen = []
        costs = {1: 10.0, 2: 12.0, 4: 14.0, 8: 22.0, 16: 44.0}
        for _ in range(12):
            width = policy.choose(128, requests=128)
            seen.append(width)
            policy.record_cost(width, 128, costs[width])
            for _ in range(128 if width > 1 else 0):
                policy.record_round(width, min(2, width - 1))
        return seen

    assert 16 not in widths_run(rows_seen=True)
    assert 16 in widths_run(rows_seen=False)


def test_a_bucket_considers_only_widths_between_its_neighbours_choices() -> None:
    """The best width falls as the batch grows: once bucket 64 chose 4 and bucket 8 chose 16,
    bucket 16 measures only 4, 8 and 16 (and bucket 2 nothing but the block)."""
    policy = WidthPolicy(16, WIDTHS)
    for bucket, cost in (
        (64, {1: 10.0, 2: 30.0, 4: 31.0, 8: 70.0, 16: 140.0}),
        (8, {1: 5.0, 2: 5.1, 4: 5.2, 8: 5.3, 16: 5.4}),
    ):
        for w in WIDTHS:
            for _ in range(MIN_SAMPLES):
                policy.record_cost(w, bucket, cost[w])
    for _ in range(200):
        policy.record_round(16, 15)  # the draft is always right
    assert policy.choose(64) == 4 and policy.choose(8) == 16
    seen = set()
    for _ in range(3 * MIN_SAMPLES):
        width = policy.choose(16)
        seen.add(width)
        policy.record_cost(width, 16, 5.0 * width)
    assert seen == {4, 8, 16}
    assert policy.choose(2) == 16  # between 16 and 16: nothing to measure
    # Choices that contradict the rule (noise) leave a bucket free to measure everything.
    tokens = expected_tokens(policy.accept(), 16)
    policy._chosen = {64: (16, tokens), 8: (1, tokens)}
    assert policy._widths_for(16, tokens) == WIDTHS
    # Choices made under another acceptance bound nothing (the rows behind them may be gone).
    policy._chosen = {64: (16, 2 * tokens), 8: (16, 2 * tokens)}
    assert policy._widths_for(16, tokens) == WIDTHS


def test_acceptance_is_counted_per_position_given_the_ones_before() -> None:
    policy = WidthPolicy(8, (1, 8))
    policy.record_round(8, 2)  # drafts 1 and 2 accepted, 3 rejected, 4 .. 7 never seen
    policy.record_round(4, 3)  # drafts 1 .. 3 accepted: a width-4 round accepts them all
    assert policy.trials == [2, 2, 2, 0, 0, 0, 0]
    assert policy.hits == [2, 2, 1, 0, 0, 0, 0]
    accept = policy.accept()
    assert accept[0] > PRIOR_ACCEPT and accept[3] == PRIOR_ACCEPT


def test_cost_is_the_least_recent_step_time() -> None:
    """Hiccups (steps stalled by the host) move nothing; old steps age out."""
    policy = WidthPolicy(4, (1, 4))
    for ms in (500.0, 11.0)[: MIN_SAMPLES - 1]:
        policy.record_cost(4, 8, ms)
    assert policy.cost(4, 8) is None  # not measured enough yet
    for ms in (11.0, 500.0, 12.0):
        policy.record_cost(4, 8, ms)
    assert policy.cost(4, 8) == 11.0
    for _ in range(RECENT_SAMPLES):
        policy.record_cost(4, 8, 13.0)
    assert policy.cost(4, 8) == 13.0  # the faster ones aged out


def test_a_width_not_run_for_long_is_measured_again() -> None:
    """A width that lost on one unlucky measurement gets another chance: after REMEASURE_EVERY
    steps it is run again, and wins once its real cost shows."""
    policy = WidthPolicy(16, WIDTHS)
    for _ in range(PROBE_ROUNDS):
        policy.record_round(2, 0)  # the drafter was probed: it missed
    for w in WIDTHS:
        for _ in range(MIN_SAMPLES):
            policy.record_cost(w, 1, 1.0 if w == 1 else 100.0)  # the wide ones: a bad start
    widths = []
    for _ in range(REMEASURE_EVERY + 2 * MIN_SAMPLES * len(WIDTHS)):
        width = policy.choose(1)
        widths.append(width)
        policy.record_cost(width, 1, 1.0 if width == 1 else 1.05)  # what they really cost
    assert widths[:REMEASURE_EVERY] == [1] * REMEASURE_EVERY
    assert 16 in widths[REMEASURE_EVERY:]
    for _ in range(50):
        policy.record_round(16, 15)  # the draft is right: the block is worth its cost
    assert policy.choose(1) == 16
