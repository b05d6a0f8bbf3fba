"""The benchmarks' hold on speculation, installed on an engine's speculator for one measurement
and removed after it: `batchrun bench` pins the verify width it times, `bench --jobs` rewrites
each step's drafts with an acceptance oracle (bench/oracle.py). `batchrun run` installs none."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from batchrun.spec_decode.base import Admitted, SpeculationHooks, Speculator


class DraftRewriter(Protocol):
    """What rewrites a step's drafts (bench/oracle.py's AcceptanceOracle)."""

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None: ...
    def rewrite(self, drafts: torch.Tensor, slots: torch.Tensor, out_len: torch.Tensor) -> None: ...


class BenchHooks(SpeculationHooks):
    def __init__(
        self, pinned_width: int | None = None, oracle: DraftRewriter | None = None
    ) -> None:
        """pinned_width: the verify width of every step (None: the policy's); oracle: rewrites
        the drafts after the draft's forward (None: they stay the draft's)."""
        self.pinned_width, self.oracle = pinned_width, oracle

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None:
        if self.oracle is not None:
            self.oracle.admit(requests, slots)

    def rewrite(self, drafts: torch.Tensor, slots: torch.Tensor, out_len: torch.Tensor) -> None:
        if self.oracle is not None:
            self.oracle.rewrite(drafts, slots, out_len)


@contextmanager
def installed(speculator: Speculator, hooks: BenchHooks) -> Iterator[None]:
    """`hooks` on `speculator` inside the block, the ones before it again after."""
    before, speculator.hooks = speculator.hooks, hooks
    try:
        yield
    finally:
        speculator.hooks = before
