"""Run an iterator ahead in a background thread, so reading Parquet and tokenizing (which
release the GIL in pyarrow and the Rust tokenizers) overlap the engine's steps."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetch(items: Iterator[T], depth: int) -> Iterator[T]:
    """The same items in the same order, produced up to `depth` ahead; an exception raised by
    `items` is raised here, where the consumer would have met it."""
    buffer: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            buffer.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which decides
            buffer.put(_Failed(exc))

    worker = threading.Thread(target=produce, name="batchrun-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item  # type: ignore[misc]
    finally:
        stop.set()
