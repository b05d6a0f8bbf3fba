"""One generation request, in three parts with one owner each: what the user asked (`Request`,
frozen), what the scheduler tracks (`RequestState`: token progress, KV pages, slot) and what is
produced (`RequestOutput`: tokens, finish, statistics, and the decoding state they advance)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchrun.sampling.logprobs import Logprobs
from batchrun.sampling.params import SamplingParams

if TYPE_CHECKING:
    from batchrun.engine.core.stop_scan import StopScan
    from batchrun.sampling.row_grammar import RowGrammar


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its KV freed, recomputed on resume)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    """What the scheduler tracks (core/scheduler.py alone writes it). Invariants: num_cached
    <= the request's tokens; `pages` cover num_cached plus the rows in flight; slot >= 0 exactly
    while RUNNING; a result launched under an older epoch is dropped."""

    status: Status = Status.WAITING
    num_cached: int = 0  # leading tokens whose target KV is committed or being prefilled
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # its row in the device state while running
    pages_on_device: int = 0  # leading pages already in the device's page table
    in_flight: int = 0  # decode/verify rows launched whose tokens the host has not read yet
    epoch: int = 0  # bumped when preempted or finished: results launched before are dropped


@dataclass(eq=False)
class RequestOutput:
    """What is produced: written by the step's commit (core/scheduler.py's update_from_output,
    through the stop rules of core/stopping.py). finish_reason is set once, with `completion`;
    with a draft, the histograms have one entry per block position."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error" (then `error` says why)
    error: str | None = None  # why it was not generated (its grammar did not compile)
    completion: str | None = None  # decoded text, set when finished
    spec_rounds: int = 0  # speculation rounds: steps that verified drafts (width > 1)
    spec_hist: list[int] | None = None  # entry k-1: rounds that committed k tokens
    # Entry k-1: rounds of width k that accepted every draft they verified (so draft k was
    # never verified): with spec_hist, the chance of each draft given the ones before.
    spec_capped: list[int] | None = None
    logprobs: Logprobs | None = None  # when the job asks for them
    grammar: RowGrammar | None = None  # a constrained request's, at its committed output
    stop_scan: StopScan | None = None  # stop-string search state, made on the first token
    thinking: int | None = None  # tokens spent in an open think block (with a thinking budget)
    # The host appended a think block's end: rounds launched since sampled without it, so the
    # request resumes from its tokens.
    forced: bool = False


@dataclass(frozen=True, eq=False)
class Request:
    """What the user asked: one sample of one input row. Its `state` and `output` are the
    scheduler's and the commit's to write."""

    row_index: int
    prompt_ids: list[int]
    params: SamplingParams
    sample_index: int = 0  # which of its row's params.n samples this is
    # The row's samples (this one included) when n > 1: they share the prompt's K/V pages.
    siblings: list[Request] = field(default_factory=list, repr=False)
    state: RequestState = field(default_factory=RequestState, repr=False)
    output: RequestOutput = field(default_factory=RequestOutput, repr=False)

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list."""
        n, output = len(self.prompt_ids), self.output.token_ids
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return output[start - n : end - n]
        return self.prompt_ids[start:] + output[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output.token_ids)


def round_tokens(hist: Iterable[int]) -> int:
    """The tokens speculation rounds committed, from their histogram (entry k-1: rounds that
    committed k tokens; a list, or a pooled numpy array)."""
    return sum(k * int(n) for k, n in enumerate(hist, start=1))


def sample_requests(request: Request) -> list[Request]:
    """The request's params.n samples: itself as sample 0, then copies seeded
    sample_seed(seed, i), all knowing each other (their shared `siblings` list)."""
    if request.params.n == 1:
        return [request]
    group = request.siblings
    group[:] = [request] + [
        Request(
            request.row_index,
            request.prompt_ids,
            dataclasses.replace(request.params, seed=sample_seed(request.params.seed, i)),
            sample_index=i,
            siblings=group,
        )
        for i in range(1, request.params.n)
    ]
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
