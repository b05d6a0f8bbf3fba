"""The verify-width policy when the drafter's acceptance changes during a job, on the CPU: the
speculator's own width choice and learning (DFlashSpeculator.next_widths and .learn, over the
real WidthPolicy) stepped over decode steps whose time comes from a cost model that charges the
drafter's work at every width, width 1 included."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from batchrun.bench.replay.costs import H200Costs
from batchrun.bench.replay.job import Job
from batchrun.bench.replay.job import speculator as model_free_speculator
from batchrun.bench.replay.step import ReplayStep
from batchrun.spec_decode.base import Speculator
from batchrun.spec_decode.width_policy import (
    HALF_LIFE,
    PRIOR_ACCEPT,
    PROBE_EVERY,
    PROBE_ROUNDS,
    WidthPolicy,
    candidate_widths,
)

BLOCK = 16
WIDTHS = candidate_widths(BLOCK)


COSTS = H200Costs()
CONTEXT = 1024  # tokens of K/V each request reads


def speculator(batch: int) -> Speculator:
    """The speculator's width logic without a model (bench/replay/job.py's)."""
    return model_free_speculator(WIDTHS, Job(rows=batch, prompt_len=1, max_tokens=1, batch=batch))


def decode_step(width: int | list[int], batch: int, writes_context: bool = True) -> ReplayStep:
    """A step in which every request decodes (in slots 0 .. batch-1, at `width` or each at its
    own), as the speculator reads it."""
    widths = tuple(width) if isinstance(width, list) else (width,) * batch
    slots = tuple(range(batch))
    return ReplayStep(widths, slots, batch, 0, batch * CONTEXT, writes_context, constrained=False)


ROW_STEPS = 256  # steps a row decodes (the jobs replay's rows): batch / ROW_STEPS replaced a step


def run(
    accept: Callable[[int], float], steps: int, batch: int, seed: int = 0
) -> list[tuple[int, float, int]]:
    """Each step's width, milliseconds and committed tokens; accept(step): each draft's chance to
    be accepted, given the ones before, at that step."""
    spec, rng = speculator(batch), random.Random(seed)
    out, replaced = [], 0.0
    for t in range(steps):
        chosen = spec.next_widths(list(range(batch)), prefill_pending=False)
        widths = [chosen[slot] for slot in range(batch)]
        replaced += batch / ROW_STEPS
        if replaced >= 1:  # the rows that finished give their slots to new ones
            new = [SimpleNamespace(row_index=t)] * int(replaced)
            spec.admit(new, torch.zeros(len(new), dtype=torch.long))
            replaced -= len(new)
        p, accepted = accept(t), []
        for width in widths:
            a = 0
            while a < width - 1 and rng.random() < p:
                a += 1
            accepted.append(a)
        step = decode_step(widths, batch, spec.writes_context)
        ms = COSTS.step(step)
        spec.learn(step, accepted, ms / 1e3)
        out.append((max(widths), ms, batch + sum(accepted)))
    return out


def speed_vs_no_draft(steps: list[tuple[int, float, int]], batch: int) -> float:
    tokens, ms = sum(s[2] for s in steps), sum(s[1] for s in steps)
    return (tokens / ms) / (batch / COSTS.step(decode_step(1, batch, writes_context=False)))


GOOD, SWITCH = 0.9, 400  # the drafter's acceptance per position, the step at which it changes
HOLD = 100  # steps over which a choice must hold to count as the policy's
PROBES = 0.1  # the share of those that may be probes or measuring steps


def settled(widths: list[int], chosen: Callable[[int], bool]) -> int:
    """Steps after SWITCH until `chosen` widths hold for HOLD steps, but for PROBES of them,
    from a step at such a width on."""
    return next(
        i - SWITCH
        for i in range(SWITCH, len(widths) - HOLD)
        if chosen(widths[i]) and sum(map(chosen, widths[i : i + HOLD])) >= (1 - PROBES) * HOLD
    )


def drop_bound(batch: int) -> int:
    """After a collapse from 0.9 to 0, p_1's hits halve every HALF_LIFE rounds while its trials
    hold, so 6 halvings take it below 0.9 / 64 = 0.014, under the 0.03 at which width 1 wins
    even where a wide verify is cheapest (batch 1: 4.6 vs 4.05 ms, the later positions still
    near their old 0.9); 16 steps more cover measuring width 1 again and the switch margin."""
    return 6 * HALF_LIFE // batch + 16


@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_a_drafter_that_collapses_is_dropped(batch: int) -> None:
    """0.9 per position, then 0: width 1 holds (but for probes) within drop_bound(batch) steps
    of the collapse (without the forgetting the policy stays wide for thousands of steps), and
    the useless phase runs at >= 0.97x of no draft, the context writes and the probes
    included."""
    useless = 3000
    steps = run(lambda t: GOOD if t < SWITCH else 0.0, SWITCH + useless, batch)
    widths = [w for w, _, _ in steps]
    assert min(widths[SWITCH - HOLD : SWITCH]) > 1, widths[:SWITCH]  # the drafter was used
    dropped = settled(widths, lambda w: w == 1)
    assert dropped <= drop_bound(batch), (dropped, widths[SWITCH : SWITCH + dropped + 1])
    assert speed_vs_no_draft(steps[SWITCH:], batch) >= 0.97


def pickup_bound(batch: int) -> int:
    """Steps within which a drafter that turned good is drafting again: the probe comes once
    the time since the last round is PROBE_EVERY probe costs (PROBE_ROUNDS rounds at width 2
    over as many width-1 steps, in the cost model), then the wide
    widths are measured (40 steps)."""
    one = COSTS.step(decode_step(1, batch))
    probe_ms = -(-PROBE_ROUNDS // batch) * (COSTS.step(decode_step(2, batch)) - one)
    return round(PROBE_EVERY * probe_ms / one) + 40


@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_a_drafter_that_turns_good_is_picked_up(batch: int) -> None:
    """0, then 0.9 per position: drafting widths hold within pickup_bound(batch) steps of the
    change (without the probe the drafter is never tried again), and run within 3% of a job
    that had the good drafter from its start."""
    after, bound = 1000, pickup_bound(batch)
    steps = run(lambda t: 0.0 if t < SWITCH else GOOD, SWITCH + bound + after, batch)
    widths = [w for w, _, _ in steps]
    held = widths[SWITCH // 2 : SWITCH]
    # The drafter was dropped: width 1 but for probes (at batch 1 a probe is PROBE_ROUNDS
    # steps, one every PROBE_EVERY probe costs and one for each new row).
    assert held.count(1) >= 0.85 * len(held), held
    assert settled(widths, lambda w: w > 1) <= bound
    good = run(lambda t: GOOD, 100 + after, batch)
    ratio = speed_vs_no_draft(steps[SWITCH + bound :], batch)
    assert ratio >= 0.97 * speed_vs_no_draft(good[100:], batch), ratio


def test_positions_no_round_reaches_fall_back_to_the_prior() -> None:
    """After a collapse only draft 1 is verified; the later positions' old 0.9 decays with the
    rounds, so that a drafter that recovers is not judged on what it did long ago."""
    policy = WidthPolicy(BLOCK, WIDTHS)
    for _ in range(20 * HALF_LIFE):
        policy.record_round(BLOCK, BLOCK - 1)
    for _ in range(20 * HALF_LIFE):
        policy.record_round(BLOCK, 0)
    accept = policy.accept()
    assert accept[0] < 0.01
    assert all(abs(p - PRIOR_ACCEPT) < 0.01 for p in accept[1:]), accept


def test_a_drafter_held_at_width_1_is_probed_at_a_cost_of_1_percent() -> None:
    """No rounds at width 1: once PROBE_EVERY times the probe's cost has passed since the last
    round, the counts are cleared and the narrowest drafting width probes (PROBE_ROUNDS rounds);
    a drafter still useless goes back to width 1. The probes cost about 1% of the time."""
    policy, batch = WidthPolicy(BLOCK, WIDTHS), 8
    seen, spent, extra = [], 0.0, 0.0
    for _ in range(5000):
        width = policy.choose(batch)
        ms = 5.0 if width == 1 else 6.0 + width / 10
        seen.append(width)
        spent, extra = spent + ms, extra + ms - 5.0
        policy.record_cost(width, batch, ms)
        policy.record_elapsed(ms)
        for _ in range(batch if width > 1 else 0):
            policy.record_round(width, 0)
    probes = [i for i, w in enumerate(seen) if w == 2]
    gaps = {b - a for a, b in zip(probes[1:], probes[2:], strict=False)}
    # A probe step costs 1.2 ms over a 5 ms width-1 step: the next probe comes PROBE_EVERY
    # times that later (the gap holds the probe step too).
    expected = PROBE_EVERY * 1.2 / 5.0
    assert all(expected <= g <= expected + 3 for g in gaps), (gaps, expected)
    assert max(seen) == 2  # a probe never led to a wide step
    assert 0.5 / PROBE_EVERY < extra / spent < 1.5 / PROBE_EVERY
