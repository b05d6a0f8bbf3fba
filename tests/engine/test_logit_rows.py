"""Which rows of a step the target's head scores: a prefill chunk that completes no prompt
samples nothing, so its step takes no logits at all (it once took every row's: 4,096 rows of a
248k vocabulary, 3.8 GiB, ran a hybrid W2 job out of memory on an H100)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.core.scheduler import Scheduler
from batchrun.engine.step_inputs import plan_step, step_args
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.sampling.params import SamplingParams
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end


def args_of(prompt_len: int, budget: int) -> tuple[int, torch.Tensor | None]:
    scheduler = Scheduler(PagePool(64, 4), 4, budget, decode_width=1)
    scheduler.add(Request(0, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4)))
    plan = plan_step(scheduler.schedule().items, 4)
    return plan.num_rows, step_args(torch.from_numpy(plan.packed), plan).logit_rows


def test_a_chunk_that_completes_no_prompt_scores_no_row() -> None:
    rows, logit_rows = args_of(prompt_len=40, budget=16)
    assert rows == 16 and logit_rows is not None and logit_rows.numel() == 0


def test_a_completing_chunk_scores_its_last_row() -> None:
    rows, logit_rows = args_of(prompt_len=10, budget=16)
    assert rows == 10 and logit_rows is not None and logit_rows.tolist() == [9]


def test_the_head_never_scores_more_rows_than_a_step_samples(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole run whose prompts span several chunks: every call of the head is for at most
    the batch's sampled rows, and the tokens are those of a run with one chunk per prompt."""
    scored: list[int] = []
    head = Qwen3ForCausalLM.logits

    def counting(self, hidden, out=None):  # type: ignore[no-untyped-def]
        scored.append(hidden.shape[0])
        return head(self, hidden, out)

    jobs = [(list(range(3, 3 + n)), SamplingParams(max_tokens=5)) for n in (37, 29)]
    whole = run_to_end(
        cpu_engine(tiny_model, None, max_batched_tokens=64, cuda_graphs=False), requests_of(jobs)
    )
    monkeypatch.setattr(Qwen3ForCausalLM, "logits", counting)
    chunked = run_to_end(
        cpu_engine(tiny_model, None, max_batched_tokens=8, cuda_graphs=False), requests_of(jobs)
    )
    assert [r.output.token_ids for r in chunked] == [r.output.token_ids for r in whole]
    assert 0 in scored and max(scored) <= 2
