"""A step's next-token masks for its constrained rows: built on the host along each row's drafts
(while the GPU runs the step's forward), applied to the step's logits on the device.

A decoding request samples rows 0 .. k-1 whose inputs are its anchor and drafts d1 .. d(k-1):
row j samples the token after d1 .. dj, so its mask is the grammar's after those drafts
(RowGrammar.fill_masks: a forbidden draft ends the walk, rows inside a think block are left
unmasked). So a constrained row's output is exactly constrained decoding without a draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchrun.sampling.grammar import Grammars
from batchrun.sampling.row_grammar import RowGrammar

# Rows unpacked at once: [rows, vocabulary] booleans and their int32 bits stay near 50 MB at
# Qwen3's vocabulary.
ROWS_PER_CHUNK = 64


@dataclass(frozen=True)
class ConstrainedRows:
    """One request's constrained rows of a step."""

    grammar: RowGrammar  # at the request's committed output
    first_row: int  # its first sampled row in the step
    num_rows: int
    drafts: Sequence[int]  # the drafts its rows 1 .. num_rows-1 take as input


@dataclass(frozen=True)
class StepMasks:
    rows: torch.Tensor  # [G] int64: the sampled rows the masks are for
    bits: torch.Tensor  # [G, ceil(V / 32)] int32: bit v of a row set = token v allowed

    def apply(self, logits: torch.Tensor) -> None:
        """Forbidden tokens' logits to -inf, in place."""
        vocab = logits.shape[-1]
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        for start in range(0, self.rows.shape[0], ROWS_PER_CHUNK):
            rows = self.rows[start : start + ROWS_PER_CHUNK]
            bits = self.bits[start : start + ROWS_PER_CHUNK, :, None]
            allowed = (bits >> shifts).bitwise_and_(1).view(rows.shape[0], -1)[:, :vocab]
            logits[rows] = logits[rows].masked_fill_(allowed == 0, float("-inf"))


def build_masks(
    grammars: Grammars, requests: Sequence[ConstrainedRows], device: torch.device
) -> StepMasks:
    """The masks of every constrained row of a step, on their way to the device."""
    bits = grammars.bitmask(sum(r.num_rows for r in requests))
    rows: list[int] = []
    for r in requests:
        r.grammar.fill_masks(bits, len(rows), r.num_rows, r.drafts)
        rows += range(r.first_row, r.first_row + r.num_rows)
    host_rows = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":  # pinned: the copies are asynchronous
        bits, host_rows = bits.pin_memory(), host_rows.pin_memory()
    return StepMasks(host_rows.to(device, non_blocking=True), bits.to(device, non_blocking=True))
