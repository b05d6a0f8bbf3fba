"""A benchmark-only acceptance oracle. A random draft accepts nothing, so DFlash gains at a real
model's shape could only be projected from step costs. The oracle measures them end to end: the
draft's forward runs for real, then its proposals are replaced by the target's own continuation
(from a target-only run of the same workload), each draft kept right with chance p given the ones
before it, p chosen so that a full block commits tau tokens on average. Every figure made with it
is labelled as such; `batchrun run` cannot reach it.

A scenario (SCENARIOS) instead gives each row a piecewise p that changes over the job: one p
before an output position, another from it on (a drafter that stops or starts fitting half way
through each row, or fits only some rows): the changing acceptance the adaptive width answers.

The continuation is bf16 arithmetic of another batch shape: where the speculative run's own
greedy token differs, that row's drafts are wrong from there on, so the measured acceptance can
fall below the design. The benchmark reports both."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from batchrun.bench.sweep import geometric_acceptance
from batchrun.device import put, to_device
from batchrun.spec_decode.base import Admitted

# A row's acceptance: each draft's chance p before an output position and from it on.
Piecewise = tuple[float, float, int]  # (early p, late p, the output position late starts at)
# (row index, rows in the job, the row's max_tokens) -> its acceptance.
Rule = Callable[[int, int, int], Piecewise]

FITS = 0.9  # a scenario's p where the drafter fits (tests/spec_decode's replays use the same)

SCENARIOS: dict[str, Rule] = {
    # Each row's output drifts where the drafter has not seen it: FITS, then nothing.
    "collapse": lambda row, rows, budget: (FITS, 0.0, budget // 2),
    # Within each row: a prompt's boilerplate first, then text the drafter knows.
    "improve in rows": lambda row, rows, budget: (0.0, FITS, budget // 2),
    # Every other row is one the drafter knows, the whole of its output.
    "mixed rows": lambda row, rows, budget: (FITS, FITS, 0) if row % 2 == 0 else (0.0, 0.0, 0),
    # The rows the drafter knows come later in the input.
    "improve": lambda row, rows, budget: (0.0, 0.0, 0) if row < rows // 2 else (FITS, FITS, 0),
}


def check_scenarios(names: Sequence[str]) -> None:
    """ValueError naming the first of `names` that is not a scenario."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}: choose from {', '.join(SCENARIOS)}")


class AcceptanceOracle:
    def __init__(
        self,
        continuations: dict[int, list[int]],
        tau: float | None,
        block_size: int,
        num_slots: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        *,
        scenario: str | None = None,
        budgets: dict[int, int] | None = None,
    ) -> None:
        """continuations: row_index -> the target's output tokens for that row. Every row at the
        constant p of `tau`, or at `scenario`'s (then tau is None); budgets: row_index -> its
        max_tokens, which a scenario's rule reads (default: its continuation's length)."""
        if (tau is None) == (scenario is None):
            raise ValueError("give the oracle one of tau and scenario")
        self.tau, self.scenario, self.vocab_size = tau, scenario, vocab_size
        if tau is not None:
            p = geometric_acceptance(tau, block_size)[0]
            self.rule: Rule = lambda row, rows, budget: (p, p, 0)
        else:
            assert scenario is not None
            self.rule = SCENARIOS[scenario]
        self.continuations = continuations
        self.budgets = budgets or {row: len(c) for row, c in continuations.items()}
        longest = max((len(c) for c in continuations.values()), default=0) + block_size
        # One row per slot (and the scratch slot), padded past the end with token 0.
        self.table = torch.zeros(num_slots + 1, longest, dtype=torch.int64, device=device)
        # Each slot's acceptance (its request's Piecewise).
        self.early = torch.zeros(num_slots + 1, dtype=torch.float32, device=device)
        self.late = torch.zeros_like(self.early)
        self.switch = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(block_size - 1, device=device)

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None:
        rows = torch.zeros(len(requests), self.table.shape[1], dtype=torch.int64)
        for i, req in enumerate(requests):
            tokens = self.continuations.get(req.row_index, [])
            rows[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self.table.index_copy_(0, slots, to_device(rows, self.table.device))
        rows_in_job = len(self.budgets)
        rules = [
            self.rule(r.row_index, rows_in_job, self.budgets.get(r.row_index, 0)) for r in requests
        ]
        for k, per_slot in enumerate((self.early, self.late, self.switch)):
            values = put([rule[k] for rule in rules], per_slot.dtype, per_slot.device)
            per_slot.index_copy_(0, slots, values)

    def rewrite(self, drafts: torch.Tensor, slots: torch.Tensor, out_len: torch.Tensor) -> None:
        """Draft j of a request proposes output token out_len + j - 1 (the anchor is the last
        committed one): the continuation's while the row's coin flips all came up right (each
        with its slot's early or late p, by that output position), then a token the target
        will not choose there."""
        d, n = drafts.shape
        if d == 0:
            return
        position = out_len[slots].unsqueeze(1) + self.offsets[:n]
        index = position.clamp(max=self.table.shape[1] - 1)
        truth = self.table[slots.unsqueeze(1), index]
        column = slots.unsqueeze(1)
        p = torch.where(position < self.switch[column], self.early[column], self.late[column])
        right = torch.rand(d, n, generator=self.generator, device=drafts.device) < p
        kept = right.cumprod(dim=1).bool()
        drafts.copy_(torch.where(kept, truth, (truth + 1) % self.vocab_size))
