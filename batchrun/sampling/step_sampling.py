"""A step's tokens and scores from the target's logits, on the device: the logit controls
(penalties.py) when a sampled row has one and the constrained rows' grammar
masks, then the sampled rows' tokens
(argmax when every row is greedy, else the seeded sampler over each row's parameters in the
per-slot tables), and the log-probabilities a job asks for, of the same processed logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.sampling.draft_verify import verify_tokens
from batchrun.sampling.grammar_masks import StepMasks
from batchrun.sampling.logprobs import PromptRows, StepLogprobs, score_step
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.penalties import VerifyRows, apply_controls
from batchrun.sampling.sampler import draws_filtered, sample
from batchrun.sampling.slot_tables import SlotTables


class TargetRows(Protocol):
    """The target's output for the step's sampled rows (the engine runner's TargetOutput)."""

    @property
    def logits(self) -> torch.Tensor: ...  # [N, V] float32 (a graph step: every padded row)
    @property
    def row_slot(self) -> torch.Tensor: ...  # [N] the slot each row samples for
    @property
    def row_step(self) -> torch.Tensor: ...  # [N] the output-token index it draws
    @property
    def hidden(self) -> torch.Tensor | None: ...  # an eager step's every row (prompt logprobs)


@dataclass(frozen=True)
class SampledRows:
    """The sampling parameters of the step's items and the rows each samples."""

    item_params: list[SamplingParams]
    counts: list[int]  # per item

    @property
    def total(self) -> int:
        return sum(self.counts)

    def params(self) -> list[SamplingParams]:
        """The sampling parameters of the items that sample a row."""
        return [p for p, k in zip(self.item_params, self.counts, strict=True) if k]

    def any_filtered(self) -> bool:
        """Some sampled row has top-k, top-p or min-p (known on the host: no search on the
        device)."""
        return any(draws_filtered(p) for p in self.params())


def processed_logits(
    model: Qwen3ForCausalLM,
    tables: SlotTables,
    out: TargetRows,
    rows: SampledRows,
    verify: VerifyRows | None,
    masks: StepMasks | None,
) -> torch.Tensor | None:
    """The step's whole-vocabulary logits with the logit controls and then the grammar masks
    applied (in place), or None when no sampled row has either. verify: the step's drafts
    and its verify rows (None: it verifies no draft)."""
    controls = tables.controls.rows(out.row_slot, out.row_step)
    controlled = controls is not None and any(p.controlled for p in rows.params())
    if not controlled and masks is None:
        return None
    logits = model.full_logits(out.logits)
    if controls is not None and controlled:
        logits = apply_controls(logits, controls, verify)
    if masks is not None:
        masks.apply(logits)
    return logits


def sample_tokens(
    model: Qwen3ForCausalLM,
    tables: SlotTables,
    out: TargetRows,
    rows: SampledRows,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token of every sampled row: argmax when every row is greedy. logits: the
    processed ones, when the step has them."""
    if all(p.temperature == 0 for p in rows.params()):
        return model.argmax(out.logits) if logits is None else logits.argmax(dim=-1)
    params = tables.batch(out.row_slot, out.row_step)
    logits = model.full_logits(out.logits) if logits is None else logits
    return sample(logits, params, any_filtered=rows.any_filtered())


def verified_tokens(
    model: Qwen3ForCausalLM,
    tables: SlotTables,
    out: TargetRows,
    rows: SampledRows,
    logits: torch.Tensor | None,
    tokens: torch.Tensor,
    proposal: tuple[torch.Tensor, torch.Tensor],
    verify: VerifyRows,
    max_width: int,
) -> torch.Tensor:
    """`tokens` with the decoding requests' verify rows (the step's first verify.num_rows, each
    request's its own width, the widest max_width) drawn by rejection sampling against the
    proposal their drafts were sampled from (q and candidate ids [>= D, B-1, K]:
    sampling/draft_verify.py), so that the drafts are accepted as often as that allows and the
    output stays the target's; unchanged when every row is greedy."""
    if all(p.temperature == 0 for p in rows.params()) or max_width < 2:
        return tokens
    n, d, p = verify.num_rows, verify.widths.shape[0], max_width - 1
    q, candidates = proposal
    logits = model.full_logits(out.logits) if logits is None else logits
    offsets = torch.cat([verify.widths.new_zeros(1), verify.widths.cumsum(0)])
    verified = verify_tokens(
        logits[:n],
        tables.batch(out.row_slot[:n], out.row_step[:n]),
        offsets,
        verify.drafts[:d, :p],
        q[:d, :p],
        candidates[:d, :p],
        rows.any_filtered(),
    )
    return torch.cat([verified, tokens[n:]])


def score_tokens(
    model: Qwen3ForCausalLM,
    tables: SlotTables,
    out: TargetRows,
    rows: SampledRows,
    tokens: torch.Tensor,
    top_k: int | None,
    prompt: PromptRows | None,
    logits: torch.Tensor | None = None,
) -> StepLogprobs:
    """The log-probabilities of the sampled tokens (padding rows left out) with their top_k
    alternatives, and of the prompt rows, on their way to the host. logits: the processed
    ones, when the step has them."""
    n = rows.total
    params = tables.batch(out.row_slot[:n], out.row_step[:n])
    return score_step(
        model.full_logits(out.logits) if logits is None else logits,
        out.hidden,
        params,
        tokens[:n],
        top_k,
        rows.any_filtered(),
        prompt,
        lambda h: model.full_logits(model.logits(h)),
    )
