"""One generation request and its sampling parameters, as the engine sees them."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from batchrun.engine.stop_scan import StopScan
from batchrun.sampling.grammar import Constraint

if TYPE_CHECKING:
    from batchrun.sampling.row_grammar import RowGrammar


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples of the row, each with its own seed (sample_seed)
    ignore_eos: bool = False  # an end-of-sequence token is output and generation goes on
    # Logit controls, as vLLM defines them (batchrun/sampling/penalties.py applies them).
    presence_penalty: float = 0.0  # [-2, 2], over output tokens
    frequency_penalty: float = 0.0  # [-2, 2], per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, 1 = off; over prompt and output tokens
    min_tokens: int = 0  # no end-of-sequence, stop id or stop string before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the top probability
    # Tokens a think block may take before its end is forced (None: no limit).
    max_thinking_tokens: int | None = None
    constraint: Constraint | None = None  # structured output: what the output must match
    # A reasoning parser splits the output: a constraint holds on the answer after the think
    # block (sampling/row_grammar.py), not from the first token.
    reasoning: bool = False

    def problem(self) -> str | None:
        """Why these parameters cannot run, or None. The engine samples in float32, so the
        float rules hold for the float32 values too; a seed is used modulo 2^64."""
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            return f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        temperature = _float32(self.temperature)
        if not (self.temperature >= 0 and math.isfinite(temperature)):
            return f"temperature must be a finite number >= 0, got {_show(self.temperature)}"
        if not (0 < self.top_p <= 1 and _float32(self.top_p) > 0):
            return f"top_p must be in (0, 1], got {_show(self.top_p)}"
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            return f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
        if not (isinstance(self.seed, int) and SEED_MIN <= self.seed < SEED_END):
            return f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}"
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            return "stop must be a list of non-empty strings"
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            return "stop_token_ids must be a list of non-negative integers"
        if not (isinstance(self.n, int) and 1 <= self.n <= MAX_SAMPLES):
            return f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be true or false, got {_show(self.ignore_eos)}"
        problem = self._controls_problem()
        if problem is not None:
            return problem
        budget = self.max_thinking_tokens
        if budget is not None and not (isinstance(budget, int) and budget >= 0):
            return f"max_thinking_tokens must be an integer >= 0, got {budget!r}"
        if self.constraint is not None:
            return self._constraint_problem(self.constraint)
        return None

    def _constraint_problem(self, constraint: Constraint) -> str | None:
        # Tokens the grammar did not choose would leave it behind the output; a thinking
        # budget's forced end closes the think block, before a reasoning row's grammar starts.
        if self.max_thinking_tokens is not None and not self.reasoning:
            return (
                f"{constraint.kind} and max_thinking_tokens do not go together without a "
                "reasoning_parser (the grammar then holds after the think block)"
            )
        if self.ignore_eos:
            return f"{constraint.kind} and ignore_eos do not go together"
        if self.min_tokens:  # its end-of-sequence mask could forbid all the grammar allows
            return f"{constraint.kind} and min_tokens do not go together"
        return constraint.problem()

    def _controls_problem(self) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _within(value, -2, 2):
                return f"{name} must be a number in [-2, 2], got {_show(value)}"
        penalty = self.repetition_penalty
        if not (_within(penalty, 0, math.inf) and 0 < _float32(penalty) < math.inf):
            return f"repetition_penalty must be a finite number > 0, got {_show(penalty)}"
        if not (_integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            return f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"
        for token, bias in self.logit_bias:
            if not (_integer(token) and token >= 0):
                return f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
            if not _within(bias, -100, 100):
                return f"logit_bias values must be numbers in [-100, 100], got {_show(bias)}"
        if not _within(self.min_p, 0, 1):
            return f"min_p must be a number in [0, 1], got {_show(self.min_p)}"
        return None

    def vocab_problem(self, vocab_size: int) -> str | None:
        """Why valid parameters cannot run on a target of this vocabulary, or None."""
        outside = [token for token, _ in self.logit_bias if token >= vocab_size]
        if outside:
            return f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
        return None

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalties: the row needs its token counts."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )

    @property
    def controlled(self) -> bool:
        """Some control changes the row's logits (min_p filters them, as top-p does)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


SEED_MIN, SEED_END = -(1 << 63), 1 << 64  # a seed's range; the engine uses it modulo 2^64
MAX_SAMPLES = 1024  # n per row: a bad cell must not fill memory with requests


def _float32(value: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _within(value: object, low: float, high: float) -> bool:
    """A finite number (not a bool) in [low, high]."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # Compared before isfinite, which cannot take an integer beyond float range.
    return number and low <= value <= high and math.isfinite(value)  # type: ignore[operator, arg-type]


def _show(value: float) -> str:
    """The value, with its float32 where that is what breaks the rule (0 or inf)."""
    single = _float32(value)
    if (single == 0 and value != 0) or (math.isinf(single) and not math.isinf(value)):
        return f"{value!r} ({single:g} in float32)"
    return repr(value)


@dataclass
class Logprobs:
    """Log-probabilities committed with a request's tokens (engine/logprobs.py); a list is
    None when the job does not ask for it."""

    tokens: list[float] | None  # one per output token
    top: list[list[tuple[int, float]]] | None  # per output token: (token id, logprob), best first
    prompt: list[float | None] | None  # per prompt token; the first has none
    # per prompt token: (token id, logprob) of the K most probable, best first; the first: None
    prompt_top: list[list[tuple[int, float]] | None] | None


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its KV freed, recomputed on resume)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    row_index: int
    prompt_ids: list[int]
    params: SamplingParams
    sample_index: int = 0  # which of its row's params.n samples this is
    # The row's samples (this one included) when n > 1: they share the prompt's K/V pages.
    siblings: list[Request] = field(default_factory=list, repr=False)
    # Filled in by the engine.
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "error" (then `error` says why)
    error: str | None = None  # why it was not generated (its grammar did not compile)
    completion: str | None = None  # decoded text, set when finished
    spec_rounds: int = 0  # speculation rounds: steps that verified drafts (width > 1)
    spec_hist: list[int] | None = None  # entry k-1: rounds that committed k tokens
    # Entry k-1: rounds of width k that accepted every draft they verified (so draft k was
    # never verified): with spec_hist, the chance of each draft given the ones before.
    spec_capped: list[int] | None = None
    # KV bookkeeping (engine-private).
    num_cached: int = 0  # leading tokens whose target KV is committed or being prefilled
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # its row in the device state while running
    pages_on_device: int = 0  # leading pages already in the device's page table
    in_flight: int = 0  # decode/verify rows launched whose tokens the host has not read yet
    epoch: int = 0  # bumped when preempted or finished: results launched before are dropped
    stop_scan: StopScan | None = None  # stop-string search state, made on the first token
    thinking: int | None = None  # tokens spent in an open think block (with a thinking budget)
    restart: bool = False  # the host forced tokens: the request resumes from its tokens
    logprobs: Logprobs | None = None  # set by the engine when the job asks for them
    grammar: RowGrammar | None = None  # a constrained request's, at its committed output

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def round_tokens(hist: Iterable[int]) -> int:
    """The tokens speculation rounds committed, from their histogram (entry k-1: rounds that
    committed k tokens; a list, or a pooled numpy array)."""
    return sum(k * int(n) for k, n in enumerate(hist, start=1))


def sample_requests(request: Request) -> list[Request]:
    """The request's params.n samples: itself as sample 0, then copies seeded
    sample_seed(seed, i), all knowing each other (their `siblings`)."""
    if request.params.n == 1:
        return [request]
    group = [request] + [
        Request(
            request.row_index,
            request.prompt_ids,
            dataclasses.replace(request.params, seed=sample_seed(request.params.seed, i)),
            sample_index=i,
        )
        for i in range(1, request.params.n)
    ]
    for sample in group:
        sample.siblings = group
    return group


def row_seed(job_seed: int, row_index: int, sample_index: int = 0) -> int:
    """The seed of a row's sample when the row names none: distinct per row and sample, fixed
    by the job seed."""
    return sample_seed((job_seed * 0x9E3779B1 + row_index) & 0x7FFFFFFFFFFFFFFF, sample_index)


_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample i of a row seeded `seed`: the seed itself for sample 0 (so a row's
    first sample is what n = 1 gives), else SplitMix64 of seed and i, so that no two samples
    (of this row or of rows with nearby seeds) share a stream."""
    if sample_index == 0:
        return seed
    z = (seed + sample_index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
