"""The draft's own time in each drafting step, on the device's clock: CUDA events on a GPU (read
once the step has been read back, so nothing waits for them), the host's clock elsewhere (the
forward runs as it is called). A drafting step costs this plus its verify, at any width: the
width policy bounds a width it has not measured by it (width_policy.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class DraftClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # id(step) -> seconds (host) or its start and end events (GPU), until the step is learnt
        self._pending: dict[int, float | tuple[torch.cuda.Event, torch.cuda.Event]] = {}

    def time(self, step: object, forward: Callable[[], T]) -> T:
        """Run `forward` (the draft of `step`), timing it."""
        if not self.cuda:
            started = time.perf_counter()
            out = forward()
            self._pending[id(step)] = time.perf_counter() - started
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward()
        end.record()
        self._pending[id(step)] = (start, end)
        return out

    def take_ms(self, step: object) -> float | None:
        """Milliseconds of `step`'s draft (None: it drafted nothing), once."""
        timed = self._pending.pop(id(step), None)
        if timed is None:
            return None
        if isinstance(timed, float):
            return timed * 1e3
        start, end = timed
        end.synchronize()  # done already: the step it belongs to has been read back
        return start.elapsed_time(end)

    def clear(self) -> None:
        self._pending.clear()
