"""A step between its launch and its read back: its forward launched (`Forward`), then the whole
step (`Launched`), and the one asynchronous copy that brings its results to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.device import to_host
from batchrun.engine.core.step import Scheduled
from batchrun.engine.model_runner import TargetOutput
from batchrun.engine.step_inputs import StepArgs, StepPlan
from batchrun.sampling.grammar_masks import ConstrainedRows
from batchrun.sampling.logprobs import PromptRows, StepLogprobs
from batchrun.sampling.step_sampling import SampledRows

HostCopy = tuple[torch.Tensor, torch.cuda.Event | None]  # values on their way, and when done


@dataclass(frozen=True)
class Forward:
    """A step whose forward is launched and whose rows are not sampled yet. Invariants: batch
    and sampled.counts run item by item; drafts (and drafts_host) exist only when the step
    drafts, drafts_host only when it is constrained."""

    batch: list[Scheduled]
    plan: StepPlan
    sampled: SampledRows
    args: StepArgs
    out: TargetOutput
    drafts: torch.Tensor | None  # [D, W-1]
    constrained: bool  # some row has a grammar: its masks come from the host
    drafts_host: HostCopy | None  # a constrained step's drafts, for its masks
    prompt: PromptRows | None
    started: float

    def constrained_rows(self) -> list[ConstrainedRows]:
        """Each constrained request's rows and the drafts they take as input (once the host
        has read the step before: the matchers are at the committed output)."""
        drafts: list[list[int]] = []
        if self.drafts_host is not None:
            host, ready = self.drafts_host
            if ready is not None:
                ready.synchronize()  # the draft forward only: the target's runs on
            drafts = host.tolist()
        requests, row, decoding = [], 0, 0
        for it in self.batch:
            grammar, k = it.req.output.grammar, it.num_sampled
            if grammar is not None and k and it.req.state.epoch == it.epoch:  # else it drops
                own = drafts[decoding] if it.decoding and drafts else []
                requests.append(ConstrainedRows(grammar, row, k, own))
            row += k
            decoding += it.decoding
        return requests


@dataclass(frozen=True)
class Launched:
    """A step on the GPU whose tokens the host has not read yet (built by keyword, as
    `Forward`); the host copy holds the sampled tokens, then one accepted count per decoding
    item, then num_drafts drafts per decoding item."""

    batch: list[Scheduled]
    plan: StepPlan
    sampled: SampledRows  # the rows each item samples
    host: torch.Tensor  # sampled tokens, accepted counts (and drafts when traced), on their way
    ready: torch.cuda.Event | None
    num_drafts: int  # drafts per decoding request copied back (0: not traced)
    seconds: float | None  # off a GPU the launch ran the step: its time
    logprobs: StepLogprobs | None = None  # when the job asks for them
    replayed: bool = False  # the target's forward replayed a CUDA graph


def copy_to_host(values: torch.Tensor) -> HostCopy:
    """An asynchronous copy into pinned memory on a GPU, and the event that marks it (and
    every copy issued before it) done."""
    host = to_host(values)
    if values.device.type != "cuda":
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
