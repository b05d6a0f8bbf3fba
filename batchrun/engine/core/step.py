"""The step contract: what the scheduler decides for one step (`ScheduledStep`, as vLLM's
SchedulerOutput), and what the host reads back of it (`StepOutput`), which the scheduler applies
in one place (core/scheduler.py's update_from_output)."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.core.requests import Request


@dataclass(frozen=True)
class Scheduled:
    """One request's part of a step."""

    req: Request
    num_new: int  # rows this request feeds to the target in this forward
    decoding: bool  # True: a decode/verify step; False: a prefill chunk


@dataclass(frozen=True)
class ScheduledStep:
    """One step, as the scheduler returns it. Decoding items come first (oldest first), then
    prefill chunks; `admitted` are the requests given a slot in this step (their device state
    is sent once); the decoding items feed `width` rows each."""

    items: list[Scheduled]
    admitted: list[Request]
    width: int


@dataclass(frozen=True)
class StepOutput:
    """A launched step's results as the host read them. Invariants: len(counts) == len(epochs)
    == len(items); tokens holds sum(counts) sampled tokens, item after item; accepted holds one
    count per decoding item, drafts num_drafts ids per decoding item (0: not traced)."""

    items: list[Scheduled]
    epochs: list[int]  # each request's epoch at launch: a later one drops the result
    counts: list[int]  # tokens each item sampled
    tokens: list[int]
    accepted: list[int]
    drafts: list[int]
    num_drafts: int
    width: int  # the step's verify width (1: plain decoding)
