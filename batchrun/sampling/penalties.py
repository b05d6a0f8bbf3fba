"""Logit controls, as vLLM applies them before temperature: logit_bias and the min_tokens mask,
then the repetition penalty (over prompt and output tokens: a seen token's logit divided by it
when positive, multiplied when negative), then the frequency and presence penalties (over output
tokens: logit -= frequency x count + presence x (count > 0)).

A row reads its request's per-slot tables (control_state.py): output-token counts, the
prompt's tokens, the bias, the ids min_tokens masks; the tables a job needs no control for are
None and cost nothing. A speculative verify row j of a decoding request samples output position
out_len + j, so its counts are the committed ones plus drafts d1 .. dj: the tables hold the
committed counts, and the logits at the draft ids are then recomputed from their raw values with
each id's count in that row (`_fix_drafts`, a few values per row). Each request verifies at
its own width, its rows packed after those of the requests before it (`VerifyRows`).

On CUDA, when triton imports, one Triton pass does every row (sampling/triton_penalties.py); the
torch code here is the reference and the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchrun.attention.meta import row_starts
from batchrun.kernels.dispatch import cuda_kernel
from batchrun.sampling.control_state import LogitControls


@dataclass(frozen=True)
class VerifyRows:
    """The verify rows that lead a step: D decoding requests' drafts [D, B-1] and, on the
    device, each request's rows [D] (its anchor and its first W_r - 1 drafts), packed by
    offsets; `num_rows` of them in all (known on the host)."""

    drafts: torch.Tensor
    widths: torch.Tensor
    num_rows: int

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each verify row's request and its place j in the request's rows."""
        d = self.widths.shape[0]
        req = torch.arange(d, device=self.widths.device)
        req = req.repeat_interleave(self.widths, output_size=self.num_rows)
        return req, torch.arange(self.num_rows, device=req.device) - row_starts(self.widths)[req]


def apply_controls(
    logits: torch.Tensor, c: LogitControls, verify: VerifyRows | None = None
) -> torch.Tensor:
    """Applies the controls to float32 logits [N, V] in place and returns them. verify: the
    rows that lead the step are verify rows (row j of request r samples after its drafts
    d1 .. dj)."""
    fix = None
    if verify is not None and verify.drafts.shape[1] and c.counts is not None:
        req, j = verify.layout()
        ids = verify.drafts[req]  # every verify row of request r looks at all of r's drafts
        fix = (req, j, ids, logits[: ids.shape[0]].gather(1, ids))  # raw: before any control
    kernel = _kernel(logits)
    if kernel is not None:
        kernel(logits, c)
    else:
        vocab = torch.arange(logits.shape[1], device=logits.device)[None, :]
        counts = c.counts[c.slot] if c.counts is not None else None
        logits.copy_(_controlled(logits, c, c.slot, c.step, vocab, counts))
    if fix is not None and verify is not None:
        _fix_drafts(logits, c, verify.drafts, *fix)
    return logits


def _controlled(
    values: torch.Tensor,
    c: LogitControls,
    slot: torch.Tensor,
    step: torch.Tensor,
    ids: torch.Tensor,
    counts: torch.Tensor | None,
) -> torch.Tensor:
    """values [R, K]: raw logits of rows owned by slot [R] at token ids [R or 1, K], with
    counts [R, K] of those ids in each row's output; the controlled values."""
    rows = slot[:, None]
    if c.bias is not None:
        values = values + c.bias[rows, ids]
    if c.stop is not None:
        early = (step < c.min_tokens[slot])[:, None]
        values = values.masked_fill(early & c.stop[rows, ids], float("-inf"))
    if counts is not None:
        seen = counts > 0
        if c.prompt is not None:
            seen = seen | c.prompt[rows, ids]
        penalty = c.repetition[rows]
        values = torch.where(
            seen, torch.where(values > 0, values / penalty, values * penalty), values
        )
        values = values - c.frequency[rows] * counts - c.presence[rows] * (counts > 0)
    return values


def _fix_drafts(
    logits: torch.Tensor,
    c: LogitControls,
    drafts: torch.Tensor,
    req: torch.Tensor,
    j: torch.Tensor,
    ids: torch.Tensor,
    raw: torch.Tensor,
) -> None:
    """Recompute the verify rows' logits at the draft ids (ids [n, B-1]: row t's request's
    drafts) with each id's count in the row: the committed count plus its occurrences among
    d1 .. dj (row j of request req). Every occurrence of an id in a row gets the same count,
    so duplicate writes agree."""
    assert c.counts is not None
    n, b = ids.shape
    same = drafts[:, :, None] == drafts[:, None, :]  # [D, i', i]: d_{i'+1} == d_{i+1}
    before = torch.arange(b, device=drafts.device)[None, :] < j[:, None]  # [n, i']: i' < j
    extra = (before[:, :, None] & same[req]).sum(1)  # [n, B-1(i)]
    slot = c.slot[:n]
    counts = c.counts[slot[:, None], ids] + extra.to(torch.int32)
    fixed = _controlled(raw, c, slot, c.step[:n], ids, counts)
    logits[:n].scatter_(1, ids, fixed)


Kernel = Callable[[torch.Tensor, LogitControls], None]


def _kernel(logits: torch.Tensor) -> Kernel | None:
    """The Triton pass for CUDA logits when triton imports; None keeps the torch path."""
    kernel: Kernel | None = cuda_kernel(
        logits, "batchrun.sampling.triton_penalties", "apply_controls_triton"
    )
    return kernel
