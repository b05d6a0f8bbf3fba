"""Logit controls, as vLLM applies them before temperature: logit_bias and the min_tokens mask,
then the repetition penalty (over prompt and output tokens: a seen token's logit divided by it
when positive, multiplied when negative), then the frequency and presence penalties (over output
tokens: logit -= frequency x count + presence x (count > 0)).

A row reads its request's per-slot tables (control_state.py): output-token counts, the
prompt's tokens, the bias, the ids min_tokens masks; the tables a job needs no control for are
None and cost nothing. A speculative verify row j of a decoding request samples output position
out_len + j, so its counts are the committed ones plus drafts d1 .. dj: the tables hold the
committed counts, and the logits at the draft ids are then recomputed from their raw values with
each id's count in that row (`_fix_drafts`, a few values per row).

On CUDA, when triton imports, one Triton pass does every row (sampling/triton_penalties.py); the
torch code here is the reference and the CPU path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from batchrun.sampling.control_state import LogitControls


def apply_controls(
    logits: torch.Tensor, c: LogitControls, drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """Applies the controls to float32 logits [N, V] in place and returns them. drafts [D, W-1]:
    rows 0 .. D*W-1 are the verify rows of D decoding requests (row r*W + j samples after
    drafts d1 .. dj of request r)."""
    ids = raw = None
    if drafts is not None and drafts.shape[1] and c.counts is not None:
        ids = _draft_ids(drafts)
        raw = logits[: ids.shape[0]].gather(1, ids)  # before any control
    kernel = _kernel(logits)
    if kernel is not None:
        kernel(logits, c)
    else:
        vocab = torch.arange(logits.shape[1], device=logits.device)[None, :]
        counts = c.counts[c.slot] if c.counts is not None else None
        logits.copy_(_controlled(logits, c, c.slot, c.step, vocab, counts))
    if ids is not None and raw is not None and drafts is not None:
        _fix_drafts(logits, c, drafts, ids, raw)
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


def _draft_ids(drafts: torch.Tensor) -> torch.Tensor:
    """[D*W, W-1]: every verify row of request r looks at all of r's drafts."""
    d, w = drafts.shape[0], drafts.shape[1] + 1
    return drafts[:, None, :].expand(d, w, w - 1).reshape(d * w, w - 1)


def _fix_drafts(
    logits: torch.Tensor,
    c: LogitControls,
    drafts: torch.Tensor,
    ids: torch.Tensor,
    raw: torch.Tensor,
) -> None:
    """Recompute the verify rows' logits at the draft ids with each id's count in the row: the
    committed count plus its occurrences among d1 .. dj (row j). Every occurrence of an id in
    a row gets the same count, so duplicate writes agree."""
    assert c.counts is not None
    d, w = drafts.shape[0], drafts.shape[1] + 1
    n = d * w
    same = drafts[:, :, None] == drafts[:, None, :]  # [D, i', i]: d_{i'+1} == d_{i+1}
    position = torch.arange(w, device=drafts.device)
    before = position[None, :-1] < position[:, None]  # [j, i']: d_{i'+1} is among d1 .. dj
    extra = (before[None, :, :, None] & same[:, None, :, :]).sum(2)  # [D, W(j), W-1(i)]
    slot = c.slot[:n]
    counts = c.counts[slot[:, None], ids] + extra.reshape(n, w - 1).to(torch.int32)
    fixed = _controlled(raw, c, slot, c.step[:n], ids, counts)
    logits[:n].scatter_(1, ids, fixed)


Kernel = Callable[[torch.Tensor, LogitControls], None]


def _kernel(logits: torch.Tensor) -> Kernel | None:
    """The Triton pass for CUDA logits when triton imports; None keeps the torch path."""
    return _import_kernel() if logits.is_cuda else None


@functools.cache
def _import_kernel() -> Kernel | None:
    try:
        from batchrun.sampling.triton_penalties import apply_controls_triton
    except ImportError:
        return None
    return apply_controls_triton
