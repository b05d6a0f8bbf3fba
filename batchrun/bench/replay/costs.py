"""What a replayed step costs: the Costs interface and the hand-written models (the H200 at the
Qwen3-8B shape, the demo pair on a 2-core CPU); fitted.py fits one to a result file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchrun.bench.replay.step import BLOCK, ReplayStep


class Costs(Protocol):
    def step(self, step: ReplayStep) -> float: ...  # milliseconds, the draft's included
    def draft(self, step: ReplayStep) -> float: ...  # the draft's own forward (0: none)
    def job_seconds(self, rows: int) -> float: ...  # a job's time outside its steps


@dataclass(frozen=True)
class H200Costs:
    """Milliseconds of a step: weights and K/V read (memory-bound) or its rows' matmuls
    (compute-bound), whichever is longer, plus the draft's forward over the whole block per
    drafting request (a row verifying above width 1), the draft's context written in a step
    that drafts nothing while the speculator writes it (10.6 against
    10.43 ms a width-1 step at batch 128 on the H200; 1.6% of a prefill row: the draft's 126M
    parameters against the target's 8B) and a constrained row's mask."""

    weights_ms: float = 4.0  # 16 GB of weights at 4 TB/s
    kv_ms_per_token: float = 0.05 / 1024  # a request's 1,024 tokens of K/V: 0.05 ms
    ms_per_row: float = 0.027  # 16 GFLOP a row at 600 TFLOP/s
    draft_ms_per_row: float = 0.0045  # 5 of 36 layers, B rows per drafting request
    draft_weights_ms: float = 0.5
    context_ms_per_request: float = 0.0013
    context_share_of_prefill: float = 0.016
    mask_ms_per_row: float = 0.004

    def draft(self, step: ReplayStep) -> float:
        if not step.drafting:
            return 0.0
        return self.draft_ms_per_row * step.drafting * BLOCK + self.draft_weights_ms

    def step(self, step: ReplayStep) -> float:
        memory = self.weights_ms + self.kv_ms_per_token * step.context
        ms = max(memory, self.ms_per_row * step.num_rows) + self.draft(step)
        ms += self.context_ms_per_request * step.context_writes  # prompts' context: always
        ms += self.ms_per_row * self.context_share_of_prefill * step.prefill_rows
        return ms + self.mask_ms_per_row * step.query_rows * step.constrained

    def job_seconds(self, rows: int) -> float:
        return 0.0


@dataclass(frozen=True)
class DemoCpuCosts:
    """Milliseconds of a step of the demo pair (batchrun/demo) on a 2-core CPU, fitted to the
    demo job's step times (48 rows, every width, engine/host_memory.py's allocator settings): a
    fixed part, a part per row, a part per request and token of context (the torch backend gathers
    each request's K/V once a layer: 2.8x a width-1 step over the job), the draft's forward
    over the drafting requests' blocks (its logits and their own context: 2.4 width-1 steps at
    first, 1.3 by the end) and its context writes at width 1 (5% of a step)."""

    fixed_ms: float = 6.35
    ms_per_row: float = 0.049
    ms_per_context_token: float = 0.00164
    draft_ms_per_request: float = 0.65
    draft_ms_per_context_token: float = 0.00115
    context_ms_per_request: float = 0.03
    prefill_ms_per_row: float = 0.075

    def draft(self, step: ReplayStep) -> float:
        if not step.drafting:
            return 0.0
        return self.draft_ms_per_request * step.drafting + (
            self.draft_ms_per_context_token * step.drafting_context
        )

    def step(self, step: ReplayStep) -> float:
        ms = self.fixed_ms + self.ms_per_row * step.query_rows
        ms += self.ms_per_context_token * step.context + self.draft(step)
        ms += self.prefill_ms_per_row * step.prefill_rows
        return ms + self.context_ms_per_request * step.context_writes

    def job_seconds(self, rows: int) -> float:
        return 0.0
