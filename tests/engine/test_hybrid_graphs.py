"""A hybrid target's decode and verify steps replay CUDA graphs (emulated off a GPU, on the
persistent buffers as a replay would be): the tokens equal the eager engine's, greedy and
seeded, with and without a drafter that is accepted, and some replays pad their batch with
requests in the scratch slot, whose linear-layer rows must touch no live request's state.
The drafter is the tests' bigram (tests/helpers/bigram_method.py), its drafts kept where a
graph reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from batchrun.engine import worker
from batchrun.engine.step_inputs import StepPlan
from batchrun.parallel.group import TensorParallel
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.base import Speculator, StepShape, TargetView
from batchrun.spec_decode.method import DraftBackends
from batchrun.spec_decode.registry import METHODS
from tests.helpers.bigram_method import (
    Bigram,
    BigramDraft,
    BigramSpeculator,
    learnt_table,
    write_draft,
)
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end
from tests.helpers.hybrid_models import VOCAB
from tests.helpers.hybrid_runs import SMALL, prompts, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=7),
]


def run(target: Path, draft: Path | None, graphs: bool, **settings: Any):
    """Every prompt under each of PARAMS (graphs: captured, emulated); finished, engine."""
    engine = cpu_engine(target, draft, **(SMALL | settings))
    if graphs:
        engine.capture_graphs()
    jobs = [(p, sp) for p in prompts() for sp in PARAMS]
    return run_to_end(engine, requests_of(jobs)), engine


class GraphedBigramSpeculator(BigramSpeculator):
    """The bigram's drafts, written into the buffer its target graphs read (as DFlash's)."""

    def __init__(self, target: TargetView, draft: BigramDraft, widths: tuple[int, ...], rows: int):
        super().__init__(target, draft, widths)
        self.drafts = torch.zeros(rows, draft.block_size - 1, dtype=torch.int64)

    def propose(self, step: StepShape, slots: torch.Tensor) -> torch.Tensor | None:
        drafts = super().propose(step, slots)
        if drafts is None:
            return None
        self.drafts[: drafts.shape[0], : drafts.shape[1]] = drafts
        return self.drafts[: drafts.shape[0], : drafts.shape[1]]

    def graph_drafts(self, size: int) -> torch.Tensor:
        return self.drafts[:size]


class GraphedBigram(Bigram):
    def make(
        self,
        target: TargetView,
        draft: nn.Module,
        backends: DraftBackends,
        *,
        widths: tuple[int, ...],
        max_batch_size: int,
        tp: TensorParallel | None,
    ) -> Speculator:
        assert isinstance(draft, BigramDraft)
        return GraphedBigramSpeculator(target, draft, widths, max_batch_size)


@pytest.fixture
def bigram(monkeypatch: pytest.MonkeyPatch) -> Bigram:
    """Overrides tests/conftest.py's: the graph-aware bigram, registered for this test only."""
    method = GraphedBigram()
    monkeypatch.setitem(METHODS, method.name, method)
    return method


@pytest.fixture
def padded(monkeypatch: pytest.MonkeyPatch) -> list[StepPlan]:
    """The steps planned with padding requests (a graph size above the live requests)."""
    plans: list[StepPlan] = []
    plan_step = worker.plan_step

    def recorded(*args: Any, **kwargs: Any) -> StepPlan:
        plan = plan_step(*args, **kwargs)
        if plan.num_requests > plan.num_live:
            plans.append(plan)
        return plan

    monkeypatch.setattr(worker, "plan_step", recorded)
    return plans


def test_a_hybrid_target_alone_replays_its_graphs(
    text_hybrid: Path, padded: list[StepPlan]
) -> None:
    eager, _ = run(text_hybrid, None, graphs=False)
    graphed, engine = run(text_hybrid, None, graphs=True)
    assert tokens(graphed) == tokens(eager)
    assert {name for name, _ in engine.runner.replays} == {"target1"}, engine.runner.replays
    assert padded, "no step padded its batch"
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("verify_width", [2, "full"])
def test_verify_steps_on_a_hybrid_target_replay_their_graphs_lossless(
    bigram: Bigram,
    text_hybrid: Path,
    tmp_path: Path,
    padded: list[StepPlan],
    verify_width: int | str,
) -> None:
    eager, _ = run(text_hybrid, None, graphs=False)
    draft = write_draft(tmp_path / "bigram", learnt_table(eager, VOCAB))
    graphed, engine = run(text_hybrid, draft, graphs=True, verify_width=verify_width)
    assert tokens(graphed) == tokens(eager)
    verified = {name for name, _ in engine.runner.replays if name != "target1"}
    assert verified, engine.runner.replays
    assert any(plan.drafting for plan in padded), "no verify step padded its batch"
    per_forward = engine.info()["tokens_per_target_forward"]
    assert per_forward is not None and per_forward > 1.0, "drafts were accepted"
