"""The replay's cost model fitted to a result file (bench/replay/fitted.py): the least squares
themselves, a model recovered from replays it priced, and the fit to the H100 measurements of
issue 46 (tests/fixtures/h100-jobs-w2-b1-drafts.json) reproducing the file's ratios."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchrun.bench.replay.fitted import Fit, FittedCosts, fit_costs, nnls, run_specs

H100 = Path(__file__).parents[1] / "fixtures" / "h100-jobs-w2-b1-drafts.json"
TOLERANCE = 0.03
# Ratios the replay misses by more than TOLERANCE today (docs/speculative-decoding.md's table
# says by how much): mostly runs at the adaptive width, whose widths the replayed policy chooses
# unlike the GPU's, and w2's oracle runs (its drift from the continuation). The GPU's own ratios
# move as much between runs: the same benchmark on one H100 at a2940b1 gave b1 collapse auto /
# none 1.321 (here 1.206, replayed 1.336) and b1 oracle tau 6.5 full / none 4.192 (here 3.869).
MISSES = {
    ("w2", "useless auto / none"),
    ("w2", "useless auto / best of none and full"),
    ("w2", "oracle tau 6.5 auto / none"),
    ("w2", "oracle tau 6.5 auto / best of none and full"),
    ("w2", "collapse auto / none"),
    ("w2", "collapse auto / best of none and full"),
    ("b1", "collapse auto / none"),
    ("b1", "collapse auto / best of none and full"),
    ("b1", "mixed rows auto / none"),
    ("b1", "mixed rows auto / best of none and full"),
    ("w2", "oracle tau 6.5 full / none"),
    ("w2", "mixed rows full / none"),
    # The file's engine drafted every decoding row once any verified drafts; the replay drafts
    # only the rows above width 1, as the engine now does: at w2 the adaptive run's rows at width
    # 1 no longer pay the drafter (0.906 replayed against 0.873 measured, +3.8%).
    ("w2", "mixed rows auto / none"),
    ("w2", "mixed rows auto / best of none and full"),
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
    the draft's own time by width): the fit prices every kind and width as that model does, its
    drafts' parts as that model's, and reproduces the ratios."""
    known = FittedCosts(
        weights_ms=6.0,
        ms_per_kv_token=4e-5,
        ms_per_row=0.02,
        ms_per_prefill_token=0.005,
        draft_ms_per_step=1.5,
        draft_ms_per_request=0.05,
        context_ms_per_request=0.0,
        eager_context_ms_per_request=0.0,
        context_ms_per_prefill_token=0.003,
        oracle_ms_per_step=0.0,
        oracle_ms_per_request=0.0,
        job_fixed_seconds=0.2,
        job_seconds_per_row=0.0,
    )
    fit = fit_costs(_synthetic(known))
    assert fit.costs.draft_ms_per_step == pytest.approx(known.draft_ms_per_step, rel=0.02)
    assert fit.costs.draft_ms_per_request == pytest.approx(known.draft_ms_per_request, rel=0.05)
    for (_, run, what), (measured, replayed) in fit.residuals.items():
        assert replayed == pytest.approx(measured, rel=0.01), (run, what)
    for key, (measured, replayed) in fit.ratios.items():
        assert replayed == pytest.approx(measured, rel=0.01), key


@cache
def h100_fit() -> Fit:
    return fit_costs(json.loads(H100.read_text()))


def _h100_ratios() -> list[Any]:
    result = json.loads(H100.read_text())
    keys = [(w, k) for w, entry in result["workloads"].items() for k in entry["ratios"]]
    return [
        pytest.param(key, marks=pytest.mark.xfail(strict=True, reason="see MISSES"))
        if key in MISSES
        else key
        for key in keys
    ]


@pytest.mark.parametrize("key", _h100_ratios(), ids=lambda key: f"{key[0]}, {key[1]}")
def test_the_h100_fit_reproduces_each_ratio(key: tuple[str, str]) -> None:
    measured, replayed = h100_fit().ratios[key]
    assert abs(replayed / measured - 1) <= TOLERANCE, (measured, replayed)
