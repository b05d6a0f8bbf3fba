"""A step's tokens and scores from the target's logits, on the device: the logit controls
(penalties, logit_bias, min_tokens) when a sampled row has one and the constrained rows' grammar
masks, then the sampled rows' tokens
(argmax when every row is greedy, else the seeded sampler over each row's parameters in the
device state), and the log-probabilities a job asks for, of the same processed logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.device_state import DeviceState
from batchrun.engine.logprobs import PromptRows, StepLogprobs, score_step
from batchrun.engine.model_runner import TargetOutput
from batchrun.engine.request import SamplingParams
from batchrun.engine.scheduler import Scheduled
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.sampling.grammar_masks import StepMasks
from batchrun.sampling.penalties import apply_controls
from batchrun.sampling.sampler import sample


@dataclass(frozen=True)
class SampledRows:
    """The step's items and the rows each samples."""

    batch: list[Scheduled]
    counts: list[int]  # per item

    @property
    def total(self) -> int:
        return sum(self.counts)

    def params(self) -> list[SamplingParams]:
        """The sampling parameters of the items that sample a row."""
        return [it.req.params for it, k in zip(self.batch, self.counts, strict=True) if k]

    def any_filtered(self) -> bool:
        """Some sampled row has top-k, top-p or min-p (known on the host: no search on the
        device)."""
        return any(
            p.top_k or p.top_p < 1 or p.min_p > 0 for p in self.params() if p.temperature > 0
        )


def processed_logits(
    model: Qwen3ForCausalLM,
    state: DeviceState,
    out: TargetOutput,
    rows: SampledRows,
    drafts: torch.Tensor | None,
    num_decoding: int,
    masks: StepMasks | None,
) -> torch.Tensor | None:
    """The step's whole-vocabulary logits with the logit controls and then the grammar masks
    applied (in place), or None when no sampled row has either. drafts: the step's [>= D,
    W-1], for the verify rows."""
    controls = state.controls.rows(out.row_slot, out.row_step)
    controlled = controls is not None and any(p.controlled for p in rows.params())
    if not controlled and masks is None:
        return None
    logits = model.full_logits(out.logits)
    if controls is not None and controlled:
        verify = drafts[:num_decoding] if drafts is not None else None
        logits = apply_controls(logits, controls, verify)
    if masks is not None:
        masks.apply(logits)
    return logits


def sample_tokens(
    model: Qwen3ForCausalLM,
    state: DeviceState,
    out: TargetOutput,
    rows: SampledRows,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token of every sampled row: argmax when every row is greedy. logits: the
    processed ones, when the step has them."""
    if all(p.temperature == 0 for p in rows.params()):
        return model.argmax(out.logits) if logits is None else logits.argmax(dim=-1)
    params = state.sampling(out.row_slot, out.row_step)
    logits = model.full_logits(out.logits) if logits is None else logits
    return sample(logits, params, any_filtered=rows.any_filtered())


def score_tokens(
    model: Qwen3ForCausalLM,
    state: DeviceState,
    out: TargetOutput,
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
    params = state.sampling(out.row_slot[:n], out.row_step[:n])
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
