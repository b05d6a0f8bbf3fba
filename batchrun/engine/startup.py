"""Seconds of each start-up stage (loading, memory sizing, graph capture), for stats.json and
`batchrun bench --jobs`: a job's start-up is part of what its user waits for."""

from __future__ import annotations

import time

import torch


class StartupClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}  # stage -> seconds, in the order they ran
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        """`stage` ends now (on a GPU: once the work it queued has run)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 3)
        self._last = now
