"""The issue's acceptance for a DFlash drafter on a hybrid Gated DeltaNet target: greedy, every
round of every row (its anchor, drafts and committed tokens) and each row's acceptance histogram
equal the definition's, the reference loop of tests/helpers/dflash_reference.py run with
transformers' Qwen3_5ForCausalLM as the target, at the full block and narrower verify widths.
The draft is trained a little on the target's continuations so that it is accepted sometimes
and not always: rounds commit every length, so every row a verify keeps is taken by a slot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.dflash_reference import RefRound, reference_generate
from tests.helpers.dflash_train import train_draft, training_prompts
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end
from tests.helpers.hybrid_models import VOCAB
from tests.kernels.test_triton_engine import run as triton_engine_run

pytestmark = pytest.mark.usefixtures("one_thread_module")  # the trained draft too

BLOCK = 4
IDS = (3, VOCAB)  # the hybrid's vocabulary past its special tokens
SEED = 0
TRAIN_STEPS = 200
MAX_TOKENS = [16, 3, 11, 1, 16, 7, 14, 9]  # some end mid-round


@pytest.fixture(scope="module")
def trained(text_hybrid: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid-dflash")
    make_tiny_draft(out, text_hybrid, block_size=BLOCK, target_layer_ids=[1, 2], seed=SEED)
    return train_draft(text_hybrid, out, steps=TRAIN_STEPS, seed=SEED, ids=IDS)


@pytest.mark.parametrize("verify_width", [2, 3, "full"])
def test_rounds_and_acceptance_equal_the_reference_loop(
    text_hybrid: Path, trained: Path, verify_width: int | str
) -> None:
    prompts = training_prompts(SEED, IDS)
    jobs = [(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    settings = {"max_batch_size": 8, "max_batched_tokens": 64, "num_pages": 96}
    engine = cpu_engine(
        text_hybrid, trained, cuda_graphs=False, verify_width=verify_width, **settings
    )
    engine.instruments.rounds = []
    finished = run_to_end(engine, requests_of(jobs))
    width = BLOCK if verify_width == "full" else int(verify_width)
    eos = sorted(engine.stopper.eos_ids)
    committed: Counter[int] = Counter()
    for row, ((prompt, params), req) in enumerate(zip(jobs, finished, strict=True)):
        out, want = reference_generate(text_hybrid, trained, prompt, params.max_tokens, eos, width)
        got = [
            RefRound(t.position, t.anchor, list(t.drafts), list(t.committed))
            for t in engine.instruments.rounds
            if t.row_index == row
        ]
        assert req.output.token_ids == out, row
        assert got == want, row
        lengths = Counter(len(r.committed) for r in want)
        hist = req.output.spec_hist
        assert hist is not None and req.output.spec_rounds == len(want), row
        assert {k: n for k, n in enumerate(hist, start=1) if n} == lengths, row
        committed += lengths
    assert set(committed) == set(range(1, width + 1)), committed  # rejected, partly, wholly


@pytest.mark.gpu
@pytest.mark.parametrize("verify_width", [2, "auto", "full"])
def test_on_the_gpu_graphs_replay_rounds_like_eager_steps(
    text_hybrid: Path, trained: Path, verify_width: int | str
) -> None:
    """On a GPU (Triton kernels, float32): the graphed engine commits what the eager one does,
    round by round, with rounds of every length. Its verify graphs allow every request the
    job's widest width, so a request verifying fewer rows (a narrower width, a row near its
    max_tokens) runs only its own in the Gated DeltaNet kernels."""
    prompts = training_prompts(SEED, IDS)
    jobs = [(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, MAX_TOKENS, strict=True)]

    def run(graphs: bool) -> tuple[list[list[int]], list[RefRound]]:
        engine, _ = triton_engine_run(
            text_hybrid,
            trained,
            [],
            attention_backend="triton",
            cuda_graphs=graphs,
            verify_width=verify_width,
            max_batched_tokens=64,
            num_pages=96,
        )
        engine.instruments.rounds = []
        finished = run_to_end(engine, requests_of(jobs))
        rounds = [
            RefRound(t.position, t.anchor, list(t.drafts), list(t.committed))
            for t in engine.instruments.rounds
        ]
        return [r.output.token_ids for r in finished], rounds

    eager_tokens, eager_rounds = run(graphs=False)
    graphed_tokens, graphed_rounds = run(graphs=True)
    assert graphed_tokens == eager_tokens
    if verify_width != "auto":  # auto's widths follow measured times: its rounds may differ
        assert graphed_rounds == eager_rounds
        assert len({len(r.committed) for r in graphed_rounds}) > 1, "rounds of one length only"
