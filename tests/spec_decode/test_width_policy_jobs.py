"""The verify-width policy over whole jobs, replayed through the engine's own scheduler and
speculator (bench/replay/job.py) over cost models that charge the drafter's work: the H200 at the
Qwen3-8B shape, and the demo pair on a 2-core CPU (where the draft's forward costs more than two
width-1 steps and a step's cost nearly triples over the job). Every scenario holds `auto` to
>= 0.97x of no draft and of the best fixed width in hindsight; each rule of the policy is pinned
by a scenario that breaks that contract without it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cache

import pytest

import batchrun.spec_decode.dflash.speculator as speculator_module
import batchrun.spec_decode.row_widths as row_widths
import batchrun.spec_decode.width_policy as width_policy
from batchrun.bench.replay.costs import Costs, DemoCpuCosts, H200Costs
from batchrun.bench.replay.job import Job, replay
from batchrun.bench.replay.scenarios import scenario

FIXED = (2, 4, 8, 16)  # `verify_width` 2 .. the block; "none" is the job without a draft


def at_batch(batch: int) -> Job:
    """Rows of 512 tokens in, 256 out, enough of them to refill the batch several times."""
    return Job(rows=max(8, 2 * batch), prompt_len=512, max_tokens=256, batch=batch)


W1 = Job(rows=256, prompt_len=1024, max_tokens=256, batch=128)  # bench/workloads.py's w1
W2 = Job(rows=64, prompt_len=1024, max_tokens=256, batch=32)
PREFILL_HEAVY = Job(rows=512, prompt_len=4096, max_tokens=64, batch=128)
DECODE_HEAVY = Job(rows=128, prompt_len=128, max_tokens=2048, batch=128)  # like w4
DEMO = Job(rows=48, prompt_len=78, max_tokens=384, batch=48)  # jobs/demo.toml
H200, CPU = H200Costs(), DemoCpuCosts()


@cache
def no_draft(job: Job, costs: Costs) -> float:
    return replay(job, None, costs=costs).tokens_per_second


def ratios(job: Job, name: str, costs: Costs = H200) -> tuple[float, float]:
    """auto against no draft, and against the best of no draft and the fixed widths."""
    accept = scenario(name, job)
    auto = replay(job, accept, costs=costs).tokens_per_second
    fixed = [replay(job, accept, w, costs=costs).tokens_per_second for w in FIXED]
    none = no_draft(job, costs)
    return auto / none, auto / max([none, *fixed])


CONSTANT, CHANGING = ["useless", "tau 3", "tau 6.5"], ["collapse", "improve", "improve in rows"]


SCENARIOS = [
    *[
        pytest.param(at_batch(b), s, id=f"batch {b}, {s}")
        for b in (1, 8, 32, 128, 256)
        for s in CONSTANT + CHANGING
    ],
    pytest.param(at_batch(8), "mixed rows", id="batch 8, mixed rows"),
    pytest.param(W1, "mixed rows", id="w1, mixed rows"),
    pytest.param(DECODE_HEAVY, "mixed rows", id="decode-heavy, mixed rows"),
    pytest.param(at_batch(1), "mixed rows", id="batch 1, mixed rows"),
    pytest.param(W2, "mixed rows", id="w2, mixed rows"),
    *[pytest.param(W1, s, id=f"w1, {s}") for s in CONSTANT + CHANGING],
    *[pytest.param(PREFILL_HEAVY, s, id=f"prefill-heavy, {s}") for s in ("useless", "tau 6.5")],
    *[pytest.param(DECODE_HEAVY, s, id=f"decode-heavy, {s}") for s in CONSTANT + ["improve"]],
]
DEMO_SCENARIOS = ["useless", "demo greedy", "demo half hot", "collapse", "improve in rows"]


@pytest.mark.parametrize("job, name", SCENARIOS)
def test_auto_keeps_up_with_no_draft_and_the_best_fixed_width(job: Job, name: str) -> None:
    vs_none, vs_best = ratios(job, name)
    assert vs_none >= 0.97 and vs_best >= 0.97, (vs_none, vs_best)


@pytest.mark.parametrize("name", DEMO_SCENARIOS)
def test_auto_keeps_up_on_the_cpu_demo(name: str) -> None:
    """The demo job's shape on the CPU cost model: the draft's forward costs 2.4 width-1 steps
    at first and 1.3 by the end, as every request's context grows."""
    vs_none, vs_best = ratios(DEMO, name, CPU)
    assert vs_none >= 0.97 and vs_best >= 0.97, (vs_none, vs_best)


def test_constrained_rows_pay_their_masks_at_every_width() -> None:
    """A mask a verified row: a wide verify costs the host more, and auto still keeps up."""
    job = Job(rows=64, prompt_len=512, max_tokens=256, batch=32, constrained=True)
    for name in ("useless", "tau 6.5"):
        vs_none, vs_best = ratios(job, name)
        assert vs_none >= 0.97 and vs_best >= 0.97, (name, vs_none, vs_best)


def _prefill_steps_measured(policy: object, **kw: object) -> int:
    return width_policy.step_width(policy, **{**kw, "prefill_pending": False})  # type: ignore[arg-type]


# Each rule, the scenario that needs it, and how the rule is taken out.
def _step_width_for_every_row(
    rows: row_widths.RowAcceptance, slots: Sequence[int], width: int, *_: object
) -> dict[int, int]:
    """Per-row widths off: every row at the step's width."""
    return dict.fromkeys(slots, width)


RULES: list[tuple[str, Job, str, Costs, Callable[[pytest.MonkeyPatch], None]]] = [
    (
        # Taken out: such steps choose their width as decode steps do (their time measured).
        "steps with prefill chunks draft only where their verify rows pay (mixed_width)",
        W1,
        "tau 3",
        H200,
        lambda mp: mp.setattr(speculator_module, "step_width", _prefill_steps_measured),
    ),
    (
        # The batch's (HALF_LIFE) and each row's (ROW_HALF_LIFE): either alone follows a
        # collapse at W1, the rows' widths from their own rounds, the step's from the batch's.
        "acceptance is forgotten (HALF_LIFE, ROW_HALF_LIFE)",
        W1,
        "collapse",
        H200,
        lambda mp: (
            mp.setattr(width_policy, "HALF_LIFE", 10**9),
            mp.setattr(row_widths, "ROW_HALF_LIFE", 10**9),
        ),
    ),
    (
        "a drafter held at width 1 is probed again (PROBE_EVERY)",
        at_batch(8),
        "improve in rows",
        H200,
        lambda mp: mp.setattr(width_policy, "PROBE_EVERY", math.inf),
    ),
    (
        "a drafter held at width 1 goes dormant (DORMANT_AFTER, or a probe that saw nothing)",
        DEMO,
        "useless",
        CPU,
        lambda mp: mp.setattr(width_policy.WidthPolicy, "dormant", property(lambda _: False)),
    ),
    (
        # Each row's own acceptance, which a row taking a slot starts afresh (row_widths.py),
        # answers the same turnover: both off, a row the drafter does not know keeps verifying.
        "rows admitted since the newest round as many as are running: probed again",
        at_batch(1),
        "mixed rows",
        H200,
        lambda mp: (
            mp.setattr(width_policy.WidthPolicy, "record_admitted", lambda *_: None),
            mp.setattr(row_widths.RowAcceptance, "widths", _step_width_for_every_row),
        ),
    ),
    (
        "a probe takes PROBE_ROUNDS rounds",
        at_batch(1),
        "useless",
        H200,
        lambda mp: mp.setattr(width_policy, "PROBE_ROUNDS", 1),
    ),
    (
        # Per-row widths alone also hold this job (the rows the drafter knows verify while the
        # others decode), so the rule is pinned with every row at the step's width.
        "another bucket's choice bounds only under the same acceptance (CHOICE_DRIFT)",
        DECODE_HEAVY,
        "improve",
        H200,
        lambda mp: (
            mp.setattr(width_policy, "CHOICE_DRIFT", math.inf),
            mp.setattr(row_widths.RowAcceptance, "widths", _step_width_for_every_row),
        ),
    ),
    (
        "the draft's own time bounds a drafting width's cost (record_draft)",
        DEMO,
        "useless",
        CPU,
        lambda mp: mp.setattr(width_policy.WidthPolicy, "record_draft", lambda *_: None),
    ),
]


@pytest.mark.parametrize("rule, job, name, costs, without", RULES, ids=[r[0] for r in RULES])
def test_each_rule_is_needed(
    rule: str,
    job: Job,
    name: str,
    costs: Costs,
    without: Callable[[pytest.MonkeyPatch], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert min(ratios(job, name, costs)) >= 0.97
    without(monkeypatch)
    no_draft.cache_clear()  # a rule may change nothing of the job without a draft; be sure
    assert min(ratios(job, name, costs)) < 0.97, rule
