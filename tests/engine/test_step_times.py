"""A job's step periods by kind and verify width (engine/step_times.py), as stats.json says them."""

from __future__ import annotations

from batchrun.engine.step_times import StepTimes


def test_periods_sum_by_kind_and_by_kind_and_width() -> None:
    times = StepTimes()
    for kind, width, seconds in [
        ("decode", 1, 0.5),
        ("decode", 16, 0.25),
        ("decode", 1, 0.25),
        ("mixed", 1, 2.0),
    ]:
        times.record(kind, width, seconds)
    assert times.info() == {
        "step_seconds": {"decode": 1.0, "mixed": 2.0},
        "width_seconds": {"decode": {"1": [2, 0.75], "16": [1, 0.25]}, "mixed": {"1": [1, 2.0]}},
    }
    assert StepTimes().info() == {"step_seconds": {}, "width_seconds": {}}
