"""What benchmarks and tests may switch on in an engine, off in jobs: GPU timing of a step's
phases with CUDA events (the draft forward; the target forward with sampling) and a record of
every verify round and of every step. Off, they cost nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchrun.engine.step_trace import StepRecord
from batchrun.spec_decode.acceptance import RoundTrace


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.enabled = False
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, ...]] = []
        self._current: list[torch.cuda.Event] = []

    def mark(self) -> None:
        """Record a phase boundary: step start, after the draft, after the target."""
        if self.enabled and self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._current.append(event)
            if len(self._current) == 3:
                self._events.append(tuple(self._current))
                self._current = []

    def reset(self, enabled: bool) -> dict[str, Any]:
        """What was recorded since the last reset (milliseconds per step); then start over."""
        if self._events:
            self._events[-1][-1].synchronize()
        out = {
            "draft_ms": [a.elapsed_time(b) for a, b, _ in self._events],
            "target_ms": [b.elapsed_time(c) for _, b, c in self._events],
        }
        self._events, self._current = [], []
        self.enabled = enabled
        return out


@dataclass
class Instruments:
    timer: StepTimer
    rounds: list[RoundTrace] | None = None  # set to a list: every verify round is appended
    steps: list[StepRecord] | None = None  # set to a list: every step read back is appended
