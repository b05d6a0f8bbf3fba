"""One step verifies each decoding row at its own width (issue 46): rows at widths 1, 3 and the
full block in the same steps, laid out by offsets, give the tokens each row gives alone at its
width, greedy and seeded, on the torch attention path (eager, and through the emulated CUDA
graphs, keyed by requests and rows) and the Triton one (interpreted on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams
from tests.helpers.dflash_train import TRAINED_BLOCK_SIZE, trained_draft_beside, training_prompts

pytestmark = pytest.mark.usefixtures("one_thread_module")

WIDTHS = (1, 3, TRAINED_BLOCK_SIZE)  # row i verifies at WIDTHS[i] in every step


def engine_of(target: Path, draft: Path, backend: str, graphs: bool) -> Engine:
    config = EngineConfig(
        target=target,
        draft=draft,
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        page_size=4,
        max_batch_size=4,
        num_pages=96,
    )
    engine = Engine(config)
    if graphs:
        engine.capture_graphs()  # off a GPU: emulated, through the graphs' padded buffers
    return engine


def jobs(sampled: bool) -> list[tuple[list[int], SamplingParams]]:
    """The trained draft's prompts (it accepts runs of every length on them); seeded rows at a
    low temperature, so that their drafts are accepted too."""
    params = [
        SamplingParams(max_tokens=14, temperature=0.2 if sampled else 0.0, top_k=20, seed=7 + i)
        for i in range(len(WIDTHS))
    ]
    return list(zip(training_prompts(seed=0)[: len(WIDTHS)], params, strict=True))


def run_rows(
    engine: Engine, work: list[tuple[list[int], SamplingParams]], rows: list[int]
) -> tuple[list[list[int]], list[tuple[int, ...]], list[int]]:
    """Rows `rows` of `work` through the engine, stepped one at a time, each decoding row at
    its own width: their tokens, every step's widths and the drafts the widest row accepted."""
    engine.new_job()
    scheduler, worker = engine.scheduler, engine.worker
    reqs = [Request(i, list(work[i][0]), work[i][1]) for i in rows]
    for req in reqs:
        scheduler.add(req)
    steps: list[tuple[int, ...]] = []
    widest: list[int] = []
    while scheduler.num_unfinished:
        widths = {req.state.slot: WIDTHS[req.row_index] for req in scheduler.running}
        forward = worker.launch_forward(scheduler.schedule(widths))
        steps.append(forward.plan.widths)
        output = worker.read(worker.launch_sampling(forward, None))
        decoding = [it for it in output.items if it.decoding]
        for it, accepted in zip(decoding, output.accepted, strict=True):
            if it.num_new == TRAINED_BLOCK_SIZE:
                widest.append(accepted)
        scheduler.update_from_output(output, stopper=engine.stopper)
    return [req.output.token_ids for req in reqs], steps, widest


@pytest.mark.parametrize(
    ("backend", "graphs"),
    [("torch", False), ("torch", True), ("triton", False)],
    ids=["torch", "torch-graphs", "triton"],
)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_rows_at_their_own_widths_in_one_step_match_each_row_alone(
    target: Path, backend: str, graphs: bool, sampled: bool
) -> None:
    draft = trained_draft_beside(target)
    engine = engine_of(target, draft, backend, graphs)
    work = jobs(sampled)
    together, steps, widest = run_rows(engine, work, list(range(len(WIDTHS))))
    alone = [run_rows(engine, work, [i])[0][0] for i in range(len(WIDTHS))]
    assert together == alone
    assert all(len(tokens) == 14 for tokens in together)
    assert sorted(WIDTHS) in [sorted(s) for s in steps], "no step held every width"
    assert max(widest) >= 2, "the full block's row never accepted a run of drafts"
    if graphs:
        replayed = {name for name, _ in engine.runner.replays}
        assert "target2" in replayed or "target4" in replayed, engine.runner.replays


def test_the_step_contract_carries_no_width() -> None:
    """Widths belong to the rows: a scheduled step and its output carry none of their own."""
    from dataclasses import fields

    from batchrun.engine.core.step import ScheduledStep, StepOutput

    for contract in (ScheduledStep, StepOutput):
        assert not [f.name for f in fields(contract) if "width" in f.name], contract
