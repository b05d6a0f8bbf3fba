"""The draft clock: each drafting step's own draft time, read once, on the device's clock."""

from __future__ import annotations

import time

import pytest
import torch

from batchrun.spec_decode.dflash.draft_clock import DraftClock


def test_the_host_clock_times_each_step_once() -> None:
    clock = DraftClock(torch.device("cpu"))
    first, second = object(), object()
    assert clock.time(first, lambda: (time.sleep(0.02), 7)[1]) == 7
    clock.time(second, lambda: None)
    assert clock.take_ms(object()) is None  # a step that drafted nothing
    assert clock.take_ms(second) < 20 <= clock.take_ms(first)  # type: ignore[operator]
    assert clock.take_ms(first) is None  # read once
    clock.time(first, lambda: None)
    clock.clear()  # an aborted job's steps are never read back
    assert clock.take_ms(first) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_events_time_the_device_work_not_the_launch() -> None:
    """Launches return at once; the events measure the GPU's time for the work."""
    clock = DraftClock(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    small, large = object(), object()
    clock.time(small, lambda: a[:64, :64] @ a[:64, :64])
    clock.time(large, lambda: [a @ a for _ in range(8)])
    torch.cuda.synchronize()
    assert 0 <= clock.take_ms(small) < clock.take_ms(large)  # type: ignore[operator]
