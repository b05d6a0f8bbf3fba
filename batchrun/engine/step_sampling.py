"""A step's tokens and scores from the target's logits, on the device: the sampled rows'
tokens (argmax when every row is greedy, else the seeded sampler over each row's parameters in
the device state), and the log-probabilities a job asks for."""

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
        """Some sampled row has top-k or top-p (known on the host: no search on the device)."""
        return any(p.top_k or p.top_p < 1 for p in self.params() if p.temperature > 0)


def sample_tokens(
    model: Qwen3ForCausalLM,
    state: DeviceState,
    out: TargetOutput,
    rows: SampledRows,
    masks: StepMasks | None = None,
) -> torch.Tensor:
    """The token of every sampled row: argmax when every row is greedy. Constrained rows'
    masks go into the logits in place, so their log-probabilities are scored from them too."""
    greedy = all(p.temperature == 0 for p in rows.params())
    if greedy and masks is None:
        return model.argmax(out.logits)
    logits = model.full_logits(out.logits)
    if masks is not None:
        masks.apply(logits)
    if greedy:
        return logits.argmax(dim=-1)
    params = state.sampling(out.row_slot, out.row_step)
    return sample(logits, params, any_filtered=rows.any_filtered())


def score_tokens(
    model: Qwen3ForCausalLM,
    state: DeviceState,
    out: TargetOutput,
    rows: SampledRows,
    tokens: torch.Tensor,
    top_k: int | None,
    prompt: PromptRows | None,
) -> StepLogprobs:
    """The log-probabilities of the sampled tokens (padding rows left out) with their top_k
    alternatives, and of the prompt rows, on their way to the host."""
    n = rows.total
    params = state.sampling(out.row_slot[:n], out.row_step[:n])
    return score_step(
        model.full_logits(out.logits),
        out.hidden,
        params,
        tokens[:n],
        top_k,
        rows.any_filtered(),
        prompt,
        lambda h: model.full_logits(model.logits(h)),
    )
