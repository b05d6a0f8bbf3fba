"""A row's n samples, gathered as they finish (in any order) until the row has them all."""

from __future__ import annotations

from typing import Generic, TypeVar

Sample = TypeVar("Sample")


class RowSamples(Generic[Sample]):
    """Samples held by row key until each row has all of its n; a row's samples come back
    together, in sample_index order, and the row is then forgotten. Every runner collects a
    row's samples here: the local run and the Ray actors by finished request, the Ray driver by
    output row (so that a part holds all of a row's output rows or none)."""

    def __init__(self) -> None:
        self._held: dict[int, dict[int, Sample]] = {}

    def holds(self, row: int, sample_index: int) -> bool:
        """Whether this sample of the row is held already (a duplicate, where rows can repeat)."""
        return sample_index in self._held.get(row, {})

    def add(self, row: int, sample_index: int, n: int, sample: Sample) -> list[Sample] | None:
        """Hold a sample of the row; the row's n samples by sample_index once this was the
        last of them, else None."""
        held = self._held.setdefault(row, {})
        held[sample_index] = sample
        if len(held) < n:
            return None
        del self._held[row]
        return [held[index] for index in sorted(held)]

    def clear(self) -> None:
        """Forget every row with samples still to come."""
        self._held.clear()
