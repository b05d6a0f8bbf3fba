"""The replay's cost model fitted to a result file (bench/replay/fitted.py): the least squares
themselves, a model recovered from replays it priced, and the fit to the H100 measurements of
issue 46 reproducing each file's ratios: the file the issue opened with (tests/fixtures/
h100-jobs-w2-b1-drafts.json) and the one with per-width step times (bench/results/
jobs-h100-w1-w2-b1-policy.json), to which the fit's step prices are fitted kind by width."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchrun.bench.replay.fitted import Fit, FittedCosts, fit_costs, fit_file, nnls, run_specs

REPO = Path(__file__).parents[2]
# The H100 file of issue 46's opening (48ad8c6, before per-width step times) and the one of the
# engine as it is (aca7ffa: per-width step times, the draft's own, w1 too).
H100_OLD = REPO / "tests" / "fixtures" / "h100-jobs-w2-b1-drafts.json"
H100 = REPO / "bench" / "results" / "jobs-h100-w1-w2-b1-policy.json"
TOLERANCE = 0.03
# Ratios each fit misses by more than TOLERANCE today (docs/speculative-decoding.md's tables say
# by how much), and why. The GPU's own ratios move as much between runs: b1 collapse auto / none
# was 1.206 at 48ad8c6, 1.321 at a2940b1 and 1.322 at aca7ffa.
OLD_ENGINE = (
    "the file's engine drafted every decoding row once any verified drafts, with a policy "
    "before per-row widths: the replay runs today's (the new file replaces these runs)"
)
B1_STEPS = (
    "b1's width-1 step priced 6.91 ms against 6.74 (weights_ms is set by w1's and w2's decode "
    "steps, whose line lies 0.1-0.2 ms above b1's) and its width-16 step 8.61 against 8.75"
)
MISSES: dict[Path, dict[tuple[str, str], str]] = {
    H100_OLD: {
        **{
            ("w2", f"{run} auto / {base}"): OLD_ENGINE
            for run in ("useless", "collapse", "mixed rows")
            for base in ("none", "best of none and full")
        },
        ("w2", "oracle tau 6.5 auto / best of none and full"): OLD_ENGINE,
        **{
            ("b1", f"{run} auto / {base}"): OLD_ENGINE
            for run in ("collapse", "mixed rows")
            for base in ("none", "best of none and full")
        },
        ("w2", "collapse full / none"): (
            "its mixed steps (no per-width times in this file) replayed 27% short: the "
            "calibrated divergence spreads the admissions over more, smaller chunks"
        ),
    },
    H100: {
        # The file's auto runs ran a policy that decoded steps with prefill chunks at width 1;
        # the replay runs today's (width_policy.py's mixed_width): those of w1 and w2 match as
        # well or better (bench/results/jobs-h100-w2-b1-policy-mixed-width.json has w2 and b1
        # run with it, but no w1 to pin the compute-bound prices: its own fit misses its full
        # runs by 6-11%).
        **{
            ("w1", f"collapse auto / {base}"): (
                "its steps after a width change replay unlike the GPU's (width 1 7% short, "
                "width 2 15% long: the fit leaves a switch unpriced, switch_ms fits to 0); "
                "the job replays 3.5% long"
            )
            for base in ("none", "best of none and full")
        },
        ("w1", "useless full / none"): (
            "its width-16 steps at 128 requests replay at 61.8 ms against 64.9: the rooflines "
            "fitted over every workload's steps underprice the widest verify at the largest batch"
        ),
        ("w1", "collapse full / none"): (
            "its width-16 decode steps replayed at 57.1 ms against 62.2: the calibrated "
            "divergence leaves fewer requests decoding in them than the GPU had"
        ),
        **{
            ("w2", f"oracle tau 6.5 auto / {base}"): (
                "the widths replay as run (width 8 mostly), but the job replays 10% short of its "
                "3.98 s: the GPU's width-2 step after a switch took 22.1 ms (13.6 replayed) and "
                "its width-8 steps 15.8 (14.5)"
            )
            for base in ("none", "best of none and full")
        },
        **{("b1", f"{run} full / none"): B1_STEPS for run in ("useless", "oracle tau 6.5")},
        **{
            ("b1", f"mixed rows auto / {base}"): (
                "the order of the rows: the replay runs them by index (a good row, then a "
                "row the drafter never gets right, which holds width 16 some 190 steps while "
                "the good row's acceptance fades), the GPU in admission_order.py's order of "
                "their random prompts, which the file does not record (228 steps at width 16 "
                "and 344 at 1, against the replay's 454 and 142: one bad row there went first)"
            )
            for base in ("none", "best of none and full")
        },
    },
}


def test_nnls_finds_a_nonnegative_solution() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 5))
    exact = np.array([1.0, 0.0, 2.0, 0.5, 0.0])
    assert np.allclose(nnls(a, a @ exact), exact, atol=1e-9)
    # b pulls the second parameter below zero: it stays at zero, the rest least squares.
    b = a @ np.array([1.0, -1.0, 2.0, 0.5, 0.0])
    x = nnls(a, b)
    assert (x >= 0).all() and x[1] == 0
    free = np.linalg.lstsq(a[:, x > 0], b, rcond=None)[0]
    assert np.allclose(x[x > 0], free, atol=1e-9)


def _synthetic(costs: FittedCosts) -> dict[str, Any]:
    """A result file whose runs took what `costs` prices their replays at, per kind and
    width: a small job with no draft, the useless drafter and the oracle at tau 6.5, at the
    full block."""
    workload = {"rows": 12, "prompt_len": [96, 96], "max_tokens": [48, 48], "batch": 4}
    result: dict[str, Any] = {
        "workloads": {"s": {"workload": {**workload, "json_schema": None}, "runs": {}}}
    }
    entry = result["workloads"]["s"]
    for name in ("none", "useless full", "oracle tau 6.5 full"):
        entry["runs"][name] = {"oracle": "oracle" in name, "steps": {}, "step_seconds": {}}
    for spec, run in run_specs(result):
        played = spec.replay(costs)
        width_seconds: dict[str, dict[str, list[float]]] = {}
        for step, ms in played.steps[1:]:
            cell = width_seconds.setdefault(step.kind, {}).setdefault(str(step.width), [0, 0.0])
            cell[0] += 1
            cell[1] += ms / 1e3
        run["width_seconds"] = width_seconds
        drafts: dict[str, list[float]] = {}
        for step, _ in played.steps[1:]:
            if step.drafting:  # the draft's own time, as the draft clock records it
                cell = drafts.setdefault(str(step.width), [0, 0.0])
                cell[0] += 1
                cell[1] += costs.draft(step) / 1e3
        run["draft_seconds"] = drafts or None
        run["steps"] = {k: sum(int(c[0]) for c in w.values()) for k, w in width_seconds.items()}
        run["step_seconds"] = {k: sum(c[1] for c in w.values()) for k, w in width_seconds.items()}
        run["generation_seconds"] = played.seconds
        run["tokens_per_second"] = played.tokens / played.seconds
    none = entry["runs"]["none"]["tokens_per_second"]
    entry["ratios"] = {
        f"{n} / none": r["tokens_per_second"] / none
        for n, r in entry["runs"].items()
        if n != "none"
    }
    return result


def test_a_model_is_recovered_from_the_steps_it_priced() -> None:
    """Replays priced by a known model, recorded as the engine records them (by kind and width,
    the draft's own time by width), with steps on both sides of each roofline: the fit finds
    each step's bound, prices every kind and width and each run's drafts as that model does,
    and reproduces the ratios (its parameters may differ: one workload's means leave some of
    them free)."""
    known = FittedCosts(
        weights_ms=6.0,
        ms_per_kv_token=4e-5,
        compute_ms=1.0,
        ms_per_row=0.15,  # 4 requests at width 16: compute-bound; at width 1: memory-bound
        ms_per_prefill_token=0.005,
        draft_ms_per_step=1.5,
        draft_compute_ms=0.5,
        draft_ms_per_request=0.4,  # 4 drafting requests: compute-bound; 1 or 2: memory-bound
        verify_ms_per_step=0.2,
        context_ms_per_request=0.0,
        eager_context_ms_per_request=0.0,
        context_ms_per_prefill_token=0.003,
        oracle_ms_per_step=0.0,
        oracle_ms_per_request=0.0,
        switch_ms=0.0,
        job_fixed_seconds=0.2,
        job_seconds_per_row=0.0,
    )
    fit = fit_costs(_synthetic(known))
    for spec, _ in run_specs(_synthetic(known)):  # the draft's mean, as the draft clock timed it
        drafted = [step for step, _ in spec.replay(known).steps[1:] if step.drafting]
        fitted, priced = (sum(c.draft(s) for s in drafted) for c in (fit.costs, known))
        assert fitted == pytest.approx(priced, rel=0.01), spec.name
    for (_, run, what), (measured, replayed) in fit.residuals.items():
        assert replayed == pytest.approx(measured, rel=0.01), (run, what)
    for key, (measured, replayed) in fit.ratios.items():
        assert replayed == pytest.approx(measured, rel=0.01), key


def fitted(path: Path) -> Fit:
    return fit_file(json.loads(path.read_text()))


def _ratios() -> list[Any]:
    params = []
    for path, misses in MISSES.items():
        result = json.loads(path.read_text())
        for w, entry in result["workloads"].items():
            for ratio in entry["ratios"]:
                reason = misses.get((w, ratio))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                params.append(
                    pytest.param(path, (w, ratio), marks=marks, id=f"{path.stem}: {w}, {ratio}")
                )
    return params


def test_every_miss_names_a_ratio_of_its_file() -> None:
    for path, misses in MISSES.items():
        result = json.loads(path.read_text())
        ratios = {(w, r) for w, entry in result["workloads"].items() for r in entry["ratios"]}
        assert set(misses) <= ratios, path


@pytest.mark.parametrize(("path", "key"), _ratios())
def test_the_h100_fits_reproduce_each_ratio(path: Path, key: tuple[str, str]) -> None:
    measured, replayed = fitted(path).ratios[key]
    assert abs(replayed / measured - 1) <= TOLERANCE, (measured, replayed)
