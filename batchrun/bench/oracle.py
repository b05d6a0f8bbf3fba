"""A benchmark-only acceptance oracle. A random draft accepts nothing, so DFlash gains at a real
model's shape could only be projected from step costs. The oracle measures them end to end: the
draft's forward runs for real, then its proposals are replaced by the target's own continuation
(from a target-only run of the same workload), each draft kept right with chance p given the ones
before it, p chosen so that a full block commits tau tokens on average. Every figure made with it
is labelled as such; `batchrun run` cannot reach it.

The continuation is bf16 arithmetic of another batch shape: where the speculative run's own
greedy token differs, that row's drafts are wrong from there on, so the measured acceptance can
fall below the design. The benchmark reports both."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchrun.bench.sweep import geometric_acceptance
from batchrun.device import to_device
from batchrun.spec_decode.base import Admitted


class AcceptanceOracle:
    def __init__(
        self,
        continuations: dict[int, list[int]],
        tau: float,
        block_size: int,
        num_slots: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        """continuations: row_index -> the target's output tokens for that row."""
        self.tau, self.vocab_size = tau, vocab_size
        self.accept = geometric_acceptance(tau, block_size)[0]
        self.continuations = continuations
        longest = max((len(c) for c in continuations.values()), default=0) + block_size
        # One row per slot (and the scratch slot), padded past the end with token 0.
        self.table = torch.zeros(num_slots + 1, longest, dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(block_size - 1, device=device)

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None:
        rows = torch.zeros(len(requests), self.table.shape[1], dtype=torch.int64)
        for i, req in enumerate(requests):
            tokens = self.continuations.get(req.row_index, [])
            rows[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self.table.index_copy_(0, slots, to_device(rows, self.table.device))

    def rewrite(self, drafts: torch.Tensor, slots: torch.Tensor, out_len: torch.Tensor) -> None:
        """Draft j of a request proposes output token out_len + j - 1 (the anchor is the last
        committed one): the continuation's while the row's coin flips all came up right, then a
        token the target will not choose there."""
        d, n = drafts.shape
        if d == 0:
            return
        index = (out_len[slots].unsqueeze(1) + self.offsets[:n]).clamp_(max=self.table.shape[1] - 1)
        truth = self.table[slots.unsqueeze(1), index]
        right = torch.rand(d, n, generator=self.generator, device=drafts.device) < self.accept
        kept = right.cumprod(dim=1).bool()
        drafts.copy_(torch.where(kept, truth, (truth + 1) % self.vocab_size))
