"""prefetch: same items, same order, errors where the consumer meets them, and it runs ahead."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from batchrun.io.input.prefetch import prefetch


def test_same_items_in_order() -> None:
    assert list(prefetch(iter(range(1000)), depth=7)) == list(range(1000))


def test_an_error_is_raised_after_the_items_before_it() -> None:
    def items() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("bad row group")

    got = []
    with pytest.raises(ValueError, match="bad row group"):
        for item in prefetch(items(), depth=4):
            got.append(item)
    assert got == [1, 2]


def test_it_runs_ahead_of_the_consumer() -> None:
    produced = threading.Semaphore(0)

    def items() -> Iterator[int]:
        for i in range(3):
            produced.release()
            yield i

    stream = prefetch(items(), depth=8)
    assert next(stream) == 0
    for _ in range(3):  # all three were produced without the consumer asking for them
        assert produced.acquire(timeout=5)
    assert list(stream) == [1, 2]


def test_a_consumer_that_stops_early_stops_the_producer() -> None:
    finished = threading.Event()

    def items() -> Iterator[int]:
        try:
            yield from range(10**9)
        finally:
            finished.set()

    stream = prefetch(items(), depth=2)
    assert next(stream) == 0
    stream.close()
    assert finished.wait(timeout=5)
