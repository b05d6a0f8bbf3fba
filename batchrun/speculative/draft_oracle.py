"""What the engine lets a benchmark do to a step's drafts: rewrite them on the device after the
draft's forward has run (its cost stays real), before the target verifies them. `batchrun bench
--jobs` uses it to measure speculation end to end at a chosen acceptance (bench/oracle.py);
nothing in `batchrun run` sets one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # speculative/ does not import the engine
    from batchrun.engine.request import Request


class DraftOracle(Protocol):
    def admit(self, requests: list[Request], slots: torch.Tensor) -> None:
        """Requests that just took their slots (`slots`: theirs, on the device)."""

    def rewrite(self, drafts: torch.Tensor, slots: torch.Tensor, out_len: torch.Tensor) -> None:
        """drafts [D, B-1] of the step's decoding requests in `slots` [D], in place; out_len:
        every slot's committed output tokens (the device state's)."""
