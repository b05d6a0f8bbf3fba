"""Log-probabilities of the sampled tokens (and of the prompt's tokens), computed on the device
from the step's logits when the job asks, and brought back with the step's results.

A sampled token's log-probability is the one under the distribution the sampler draws from
(vLLM's processed logprobs): log_softmax(logits / T) of the logits after the logit controls
(sampling/penalties.py; the caller passes them), with the tokens that min-p/top-k/top-p drop at
-inf (sampler.filter_candidates, the sampler's own filter), and for a greedy row (T = 0) the
log_softmax of the controlled logits. A verify row's logits are the target's at that position, so a
committed token's values are the same with and without a draft. A prompt token's
log-probability is the plain log_softmax of the target's logits at the position before it
(a prompt is not sampled); the first prompt token has none. With prompt_logprobs = K > 0 each
prompt token also gets the K most probable tokens of that distribution.

Rows are scored in chunks, so the vocabulary-sized temporaries stay bounded: the sampled rows'
under the sampler's budget, the prompt rows' (whose logits exist only here) under
PROMPT_CHUNK_BYTES. The values leave the device through asynchronous copies issued before the
event that marks the step's results ready, so scoring adds no synchronisation of its own (rows
with top-k/top-p synchronise in the filter, as they do in the sampler).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from batchrun.device import to_device, to_host
from batchrun.sampling.sampler import SamplingBatch, rows_per_chunk

PROMPT_CHUNK_BYTES = 64 << 20
# A prompt row's logits in the model's dtype (up to 2 bytes), in float32 and log-softmaxed.
PROMPT_BYTES_PER_LOGIT = 10


@dataclass
class Logprobs:
    """Log-probabilities committed with a request's tokens; a list is None when the job does
    not ask for it."""

    tokens: list[float] | None  # one per output token
    top: list[list[tuple[int, float]]] | None  # per output token: (token id, logprob), best first
    prompt: list[float | None] | None  # per prompt token; the first has none
    # per prompt token: (token id, logprob) of the K most probable, best first; the first: None
    prompt_top: list[list[tuple[int, float]] | None] | None


class ScoredOutput(Protocol):
    @property
    def logprobs(self) -> Logprobs | None: ...


class ScoredRequest(Protocol):
    """What prompt scoring reads of a request (the engine's Request)."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def output(self) -> ScoredOutput: ...


class ScoredItem(Protocol):
    """A request's part of a step (the engine's Scheduled): its rows, a prefill chunk's or not."""

    @property
    def req(self) -> ScoredRequest: ...
    @property
    def num_new(self) -> int: ...
    @property
    def decoding(self) -> bool: ...
    @property
    def start(self) -> int: ...  # a chunk's first position


def token_logprobs(
    logits: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor, k: int, any_filtered: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits [N, V] and the tokens [N] drawn from them: each token's log-probability [N]
    float32 and the k most probable tokens of each row, (values [N, k] float32 descending,
    ids [N, k] int64). any_filtered=False: no row has top-k/top-p (no search for them)."""
    num_rows, vocab = logits.shape
    device = logits.device
    chosen = torch.empty(num_rows, dtype=torch.float32, device=device)
    top_values = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    top_ids = torch.empty(num_rows, k, dtype=torch.int64, device=device)
    size = rows_per_chunk(num_rows, vocab)
    for start in range(0, num_rows, size):
        rows = slice(start, start + size)
        scores = _processed(logits[rows], batch, rows, any_filtered)
        chosen[rows] = scores.gather(1, tokens[rows, None]).squeeze(1)
        if k:
            top_values[rows], top_ids[rows] = scores.topk(k, dim=-1)
    return chosen, top_values, top_ids


def _processed(
    logits: torch.Tensor, batch: SamplingBatch, rows: slice, any_filtered: bool
) -> torch.Tensor:
    """log_softmax of the distribution each of the rows samples from (the module docstring)."""
    t = batch.temperature[rows]
    scale = torch.where(t > 0, t, 1.0)[:, None]  # x / 1 is exact
    scaled = logits.to(torch.float32, copy=True).div_(scale)  # the sampler's logits stay
    if any_filtered:
        index = ((t > 0) & batch.filtered()[rows]).nonzero().squeeze(1)
        if index.numel():
            values, ids = batch.candidates(scaled[index], index + rows.start)
            kept = torch.full((index.numel(), scaled.shape[1]), float("-inf"), device=ids.device)
            scaled[index] = kept.scatter_(1, ids, values)
    return scaled.log_softmax(dim=-1)


def prompt_token_logprobs(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
    vocab: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax(logits(hidden[rows[i]])) at targets[i], [M] float32, and its k most
    probable tokens, (values [M, k] float32 descending, ids [M, k] int64), a chunk of rows at
    a time (logits: the target's float32 logits [*, vocab] of hidden rows)."""
    num_rows, device = rows.shape[0], hidden.device
    chosen = torch.empty(num_rows, dtype=torch.float32, device=device)
    top_values = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    top_ids = torch.empty(num_rows, k, dtype=torch.int64, device=device)
    size = max(1, PROMPT_CHUNK_BYTES // (PROMPT_BYTES_PER_LOGIT * vocab))
    for start in range(0, num_rows, size):
        chunk = slice(start, start + size)
        scores = logits(hidden[rows[chunk]]).log_softmax(dim=-1)
        chosen[chunk] = scores.gather(1, targets[chunk, None]).squeeze(1)
        if k:
            top_values[chunk], top_ids[chunk] = scores.topk(k, dim=-1)
    return chosen, top_values, top_ids


@dataclass(frozen=True)
class PromptRows:
    """The step's rows that score prompt tokens: a prefill row at position i scores prompt
    token i + 1. Per batch item, (first prompt position scored, how many); their rows and
    tokens in item order; k: the most probable tokens each lists (the job's prompt_logprobs)."""

    spans: list[tuple[int, int]]
    rows: list[int]
    targets: list[int]
    k: int


def prompt_rows(batch: Sequence[ScoredItem], k: int) -> PromptRows:
    """Built at launch, from the items' snapshots. Positions a request has
    scored already are left out: recomputed after a preemption, which drops the results of its
    steps still in flight, and readmits it in a later pass, once they have been read back."""
    spans: list[tuple[int, int]] = []
    rows: list[int] = []
    targets: list[int] = []
    row = 0
    for it in batch:
        req, span = it.req, (0, 0)
        logprobs = req.output.logprobs
        scored = logprobs.prompt if logprobs is not None else None
        if not it.decoding and scored is not None:
            start = it.start
            first = max(start + 1, len(scored))
            end = min(start + it.num_new + 1, len(req.prompt_ids))
            if end > first:
                span = (first, end - first)
                rows.extend(range(row + first - 1 - start, row + end - 1 - start))
                targets.extend(req.prompt_ids[first:end])
        spans.append(span)
        row += it.num_new
    return PromptRows(spans, rows, targets, k)


@dataclass(frozen=True)
class StepLogprobs:
    """A step's log-probabilities, on their way to the host: `values` holds the sampled
    rows' chosen tokens' [N], their top-k values [N * k], then the prompt rows' [M] and their
    top-K values [M * K]; `top_ids` the sampled rows' top-k ids [N * k], then the prompt rows'
    [M * K]."""

    values: torch.Tensor  # float32
    top_ids: torch.Tensor  # int64
    num_sampled: int  # N (0: sampled tokens are not scored)
    k: int
    prompt_spans: list[tuple[int, int]]  # per batch item, PromptRows.spans
    prompt_k: int  # K


def score_step(
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
    batch: SamplingBatch,
    tokens: torch.Tensor,
    k: int | None,
    any_filtered: bool,
    prompt: PromptRows | None,
    model_logits: Callable[[torch.Tensor], torch.Tensor],
) -> StepLogprobs:
    """Scores the step's N sampled rows (logits [>= N, V], tokens [N]; k None: not asked) and
    its prompt rows, and starts their copies to the host."""
    device = logits.device
    parts, id_parts, num_sampled = [], [], 0
    if k is not None:
        num_sampled = tokens.shape[0]
        chosen, top_values, ids = token_logprobs(
            logits[:num_sampled], batch, tokens, k, any_filtered
        )
        parts += [chosen, top_values.view(-1)]
        id_parts.append(ids.view(-1))
    if prompt is not None and prompt.rows:
        assert hidden is not None, "a step with prefill chunks runs eagerly"
        rows = to_device(torch.tensor(prompt.rows, dtype=torch.int64), device)
        targets = to_device(torch.tensor(prompt.targets, dtype=torch.int64), device)
        chosen, top_values, ids = prompt_token_logprobs(
            hidden, rows, targets, model_logits, logits.shape[1], prompt.k
        )
        parts += [chosen, top_values.view(-1)]
        id_parts.append(ids.view(-1))
    values = torch.cat(parts) if parts else torch.zeros(0, device=device)
    top_ids = torch.cat(id_parts) if id_parts else torch.zeros(0, dtype=torch.int64, device=device)
    spans, prompt_k = (prompt.spans, prompt.k) if prompt is not None else ([], 0)
    return StepLogprobs(to_host(values), to_host(top_ids), num_sampled, k or 0, spans, prompt_k)


class ReadLogprobs:
    """A step's log-probabilities on the host (read once its results are ready), committed to
    requests along with their tokens."""

    def __init__(self, step: StepLogprobs) -> None:
        values, n, k = step.values.tolist(), step.num_sampled, step.k
        ids = step.top_ids.tolist()
        self.prompt_spans = step.prompt_spans
        self.prompt_at = [0]  # where each item's prompt values start
        for _, count in step.prompt_spans:
            self.prompt_at.append(self.prompt_at[-1] + count)
        m = self.prompt_at[-1]
        self.k, self.prompt_k = k, step.prompt_k
        self.chosen = values[:n]
        self.top_values = values[n : n + n * k]
        self.top_ids = ids[: n * k]
        self.prompt = values[n + n * k : n + n * k + m]
        self.prompt_top_values = values[n + n * k + m :]
        self.prompt_top_ids = ids[n * k :]

    def commit(self, scored: Logprobs | None, item: int, row: int, kept: int) -> None:
        """A request's log-probabilities (None: the job asks for none), of batch item `item`,
        which kept the tokens of sampled rows row .. row+kept-1."""
        if scored is None:
            return
        if scored.tokens is not None:
            scored.tokens.extend(self.chosen[row : row + kept])
        if scored.top is not None:
            for r in range(row, row + kept):
                # Tokens the filter dropped are no part of the distribution.
                pairs = _top(self.top_ids, self.top_values, r, self.k)
                scored.top.append([(i, v) for i, v in pairs if v > -math.inf])
        if scored.prompt is not None and item < len(self.prompt_spans):
            first, count = self.prompt_spans[item]
            assert not count or first == len(scored.prompt), "prompt positions come in order"
            at = self.prompt_at[item]
            scored.prompt.extend(self.prompt[at : at + count])
            if scored.prompt_top is not None:
                ids, values, k = self.prompt_top_ids, self.prompt_top_values, self.prompt_k
                scored.prompt_top.extend(_top(ids, values, r, k) for r in range(at, at + count))


def _top(ids: list[int], values: list[float], row: int, k: int) -> list[tuple[int, float]]:
    """Row `row`'s k (token id, logprob) pairs of flat [rows * k] lists."""
    cut = slice(row * k, (row + 1) * k)
    return list(zip(ids[cut], values[cut], strict=True))


def asked_logprobs(k: int | None, prompt_k: int | None) -> Logprobs | None:
    """What a request records for a job's logprobs = k and prompt_logprobs = K (None: off)."""
    if k is None and prompt_k is None:
        return None
    return Logprobs(
        tokens=[] if k is not None else None,
        top=[] if k else None,
        prompt=[None] if prompt_k is not None else None,
        prompt_top=[None] if prompt_k else None,
    )
