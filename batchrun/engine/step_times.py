"""Where a job's time went, as the engine measures it: each step's period (the time between its
results and the previous step's) summed by step kind (prefill, mixed, decode) and verify width,
with how many steps each sum holds. A cost model is fitted to these (bench/replay/fitted.py)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class StepTimes:
    def __init__(self) -> None:
        # (kind, width) -> [steps, seconds]
        self._sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0])

    def record(self, kind: str, width: int, seconds: float) -> None:
        entry = self._sums[kind, width]
        entry[0] += 1
        entry[1] += seconds

    def info(self) -> dict[str, Any]:
        """step_seconds: seconds by kind; width_seconds: kind -> width -> [steps, seconds]."""
        by_kind: dict[str, float] = defaultdict(float)
        by_width: dict[str, dict[str, list[float]]] = defaultdict(dict)
        for (kind, width), (steps, seconds) in sorted(self._sums.items()):
            by_kind[kind] += seconds
            by_width[kind][str(width)] = [int(steps), round(seconds, 4)]
        return {
            "step_seconds": {k: round(v, 4) for k, v in by_kind.items()},
            "width_seconds": dict(by_width),
        }
