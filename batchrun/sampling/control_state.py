"""Per-slot state of the logit controls (penalties.py applies them), on the device.

Nothing exists until a request with a control is admitted: a job without them pays no memory
and no kernels. Then each table is allocated when a request first needs it ([slots + 1, vocab]:
output-token counts, int32, for the penalties; the prompt's tokens for the repetition penalty;
the bias; the ids min_tokens masks) and kept for the job. A slot's rows are filled when a request
takes it (`admit`: from its prompt and its output ids, which a request resumed after a preemption
or a thinking-budget restart already has); a slot whose request has no control keeps stale rows
that its neutral parameters leave unused (the bias, added to every row, is cleared). `commit`
counts the tokens a step committed, on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from batchrun.device import put
from batchrun.sampling.params import SamplingParams


class OutputTokens(Protocol):
    @property
    def token_ids(self) -> list[int]: ...


class SlotRequest(Protocol):
    """What filling a slot reads of a request (the engine's Request): its parameters, and the
    tokens its tables start from (a resumed request's output so far)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def output(self) -> OutputTokens: ...


@dataclass(frozen=True)
class LogitControls:
    """The step's rows and the per-slot tables (indexed by slot) they read."""

    slot: torch.Tensor  # [N] each row's slot
    step: torch.Tensor  # [N] the output position it samples (min_tokens masks below it)
    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    repetition: torch.Tensor  # [S] float32, 1 = off
    min_tokens: torch.Tensor  # [S] int64
    counts: torch.Tensor | None  # [S, V] int32: committed output tokens
    prompt: torch.Tensor | None  # [S, V] bool: the prompt's tokens (repetition)
    bias: torch.Tensor | None  # [S, V] float32
    stop: torch.Tensor | None  # [S, V] bool: ids masked before min_tokens


class ControlState:
    """The controls' per-slot tables (the module docstring): scalars [4, slots + 1] once any
    request has had a control, each [slots + 1, vocab] table once a request needs it; None
    before."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.size, self.vocab_size, self.device = num_slots + 1, vocab_size, device
        self.eos_ids: frozenset[int] = frozenset()  # masked by min_tokens (unless ignore_eos)
        self.scalars: torch.Tensor | None = None  # [4, S] presence, frequency, repetition, min
        self.counts: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.stop: torch.Tensor | None = None

    def admit(self, reqs: Sequence[SlotRequest], slots: torch.Tensor) -> None:
        params = [r.params for r in reqs]
        if self.scalars is None and not any(p.controlled for p in params):
            return
        self._allocate(reqs)
        assert self.scalars is not None
        values = [
            [p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens]
            for p in params
        ]
        self.scalars[:, slots] = put(values, torch.float32, self.device).T
        if self.counts is not None:
            self.counts[slots] = 0
            pick = [i for i, p in enumerate(params) if p.penalized]
            self._mark(
                self.counts, slots, reqs, pick, lambda r: r.output.token_ids, accumulate=True
            )
        if self.prompt is not None:
            pick = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
            self.prompt[slots[pick]] = False
            self._mark(self.prompt, slots, reqs, pick, lambda r: r.prompt_ids)
        if self.bias is not None:
            self.bias[slots] = 0.0
            pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
            if pairs:
                at = put([[i, t] for i, t, _ in pairs], torch.int64, self.device)
                values_at = put([b for *_, b in pairs], torch.float32, self.device)
                self.bias[slots[at[:, 0]], at[:, 1]] = values_at
        if self.stop is not None:
            pick = [i for i, p in enumerate(params) if p.min_tokens]
            self.stop[slots[pick]] = False
            self._mark(self.stop, slots, reqs, pick, self._stop_ids)

    def _allocate(self, reqs: Sequence[SlotRequest]) -> None:
        params = [r.params for r in reqs]
        shape = (self.size, self.vocab_size)
        if self.scalars is None:
            self.scalars = torch.zeros(4, self.size, device=self.device)
            self.scalars[2] = 1.0  # repetition off
        if self.counts is None and any(p.penalized for p in params):
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        if self.prompt is None and any(p.repetition_penalty != 1 for p in params):
            self.prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if self.bias is None and any(p.logit_bias for p in params):
            self.bias = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.stop is None and any(p.min_tokens for p in params):
            self.stop = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def _stop_ids(self, req: SlotRequest) -> list[int]:
        eos = () if req.params.ignore_eos else self.eos_ids
        return [t for t in (*eos, *req.params.stop_token_ids) if t < self.vocab_size]

    def _mark(
        self,
        table: torch.Tensor,
        slots: torch.Tensor,
        reqs: Sequence[SlotRequest],
        pick: list[int],
        ids_of: Callable[[SlotRequest], list[int]],
        accumulate: bool = False,
    ) -> None:
        """table[slot of reqs[i], token] = 1 (or += 1) for each of ids_of(reqs[i]), i in pick."""
        rows = [i for i in pick for _ in ids_of(reqs[i])]
        if not rows:
            return
        tokens = [t for i in pick for t in ids_of(reqs[i])]
        at = (slots[put(rows, torch.int64, self.device)], put(tokens, torch.int64, self.device))
        ones = torch.ones(len(rows), dtype=table.dtype, device=self.device)
        table.index_put_(at, ones, accumulate=accumulate)

    def rows(self, slot: torch.Tensor, step: torch.Tensor) -> LogitControls | None:
        """The controls of rows owned by `slot`, sampling output position `step` (None: no
        request has had a control)."""
        if self.scalars is None:
            return None
        presence, frequency, repetition, min_tokens = self.scalars
        return LogitControls(
            slot=slot,
            step=step,
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            min_tokens=min_tokens.long(),
            counts=self.counts,
            prompt=self.prompt,
            bias=self.bias,
            stop=self.stop,
        )

    def commit(
        self,
        slots: torch.Tensor,  # [R] the step's requests, D decoding first
        post: torch.Tensor,  # [D, W] the decoding requests' sampled tokens
        accepted: torch.Tensor,  # [D]
        chunk_token: torch.Tensor,  # [R] a completing chunk's first token (elsewhere: any)
        chunk_sampled: torch.Tensor,  # [R] bool: the request is a completing chunk
    ) -> None:
        """Counts the committed tokens: a decoding request's rows 0 .. accepted, a completing
        chunk's first token."""
        if self.counts is None:
            return
        d, w = post.shape
        if d:
            keep = torch.arange(w, device=post.device)[None, :] <= accepted[:, None]
            at = (slots[:d, None].expand(d, w), post)
            self.counts.index_put_(at, keep.to(torch.int32), accumulate=True)
        self.counts.index_put_((slots, chunk_token), chunk_sampled.to(torch.int32), accumulate=True)
