"""The benchmark's acceptance oracle on the CPU (float32): the target's own continuation,
kept right with a geometric profile, gives the acceptance it was designed for and changes no
output. (On the GPU the rewritten drafts reach the captured target graph through the buffer it
reads: the job benchmark's measured acceptance shows it.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from batchrun.bench.hooks import BenchHooks
from batchrun.bench.oracle import AcceptanceOracle
from batchrun.engine.core.requests import Request
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.engine_runs import cpu_engine, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread_module")
BLOCK = 8
SETTINGS = {
    "max_batch_size": 8,
    "max_batched_tokens": 128,
    "num_pages": 256,
    "verify_width": "full",
}


@pytest.fixture(scope="module")
def draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), target, block_size=BLOCK)


def requests(vocab: int) -> list[Request]:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=48)
    return [Request(i, [rng.randrange(3, vocab) for _ in range(5 + i)], params) for i in range(8)]


@pytest.mark.parametrize("tau", [1.0, 3.0, 6.5])
def test_the_oracle_gives_its_acceptance_and_the_target_output(
    target: Path, draft: Path, tau: float
) -> None:
    plain = run_to_end(cpu_engine(target, None, **SETTINGS), requests(1000))
    continuation = {r.row_index: r.output.token_ids for r in plain}
    engine = cpu_engine(target, draft, **SETTINGS)
    oracle = AcceptanceOracle(
        continuation, tau, BLOCK, engine.config.max_batch_size, engine.vocab_size, engine.device
    )
    engine.speculator.hooks = BenchHooks(oracle=oracle)
    spec = run_to_end(engine, requests(1000))
    assert [r.output.token_ids for r in spec] == [r.output.token_ids for r in plain]
    rounds = sum(r.output.spec_rounds for r in spec)
    measured = sum(len(r.output.token_ids) - 1 for r in spec) / rounds
    if tau == 1.0:
        assert measured == 1.0  # nothing accepted, ever
    else:  # a round's length is capped by max_tokens at the end, so a little under
        assert tau * 0.8 < measured <= tau * 1.1, measured
