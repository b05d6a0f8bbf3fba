"""The benchmark's acceptance oracle on the CPU (float32): the target's own continuation,
kept right with a geometric profile, gives the acceptance it was designed for and changes no
output. (On the GPU the rewritten drafts reach the captured target graph through the buffer it
reads: the job benchmark's measured acceptance shows it.)"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

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


@dataclass(frozen=True)
class Row:
    row_index: int


def drawn(scenario: str, rows: int, budget: int, draws: int) -> tuple[Tensor, Tensor, Tensor]:
    """The oracle's drafts in `scenario` for every row of a job of `rows` rows of `budget`
    tokens, each slot's request at every output length, `draws` times: whether each draft is
    its continuation's token [draws, budget, rows, BLOCK - 1], the drafts' output positions
    [budget, 1, BLOCK - 1] and whether each was wrong as the oracle writes a wrong one."""
    vocab = 1000
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(0, vocab, (rows, budget), generator=gen)
    continuation = {r: table[r].tolist() for r in range(rows)}
    oracle = AcceptanceOracle(
        continuation,
        None,
        BLOCK,
        rows,
        vocab,
        torch.device("cpu"),
        scenario=scenario,
        budgets=dict.fromkeys(range(rows), budget),
    )
    slots = torch.arange(rows)
    oracle.admit([Row(r) for r in range(rows)], slots)
    positions = torch.arange(budget).unsqueeze(1) + torch.arange(BLOCK - 1)  # [out_len, draft]
    padded = torch.cat([table, torch.zeros(rows, BLOCK, dtype=torch.int64)], dim=1)  # as it pads
    truth = padded[:, positions].transpose(0, 1)  # [out_len, row, draft]
    right = torch.empty(draws, budget, rows, BLOCK - 1, dtype=torch.bool)
    miss = torch.empty_like(right)
    for d in range(draws):
        for length in range(budget):
            drafts = torch.empty(rows, BLOCK - 1, dtype=torch.int64)
            oracle.rewrite(drafts, slots, torch.full((rows + 1,), length))
            right[d, length] = drafts == truth[length]
            miss[d, length] = drafts == (truth[length] + 1) % vocab
    return right, positions.unsqueeze(1), miss


def test_collapse_keeps_drafts_right_until_half_of_each_row_then_none() -> None:
    budget = 40  # the switch: output position 20
    right, positions, miss = drawn("collapse", 4, budget, 50)
    assert (right | miss).all()  # the continuation's token, or one the target will not choose
    assert (right.cumprod(dim=-1).bool() == right).all()  # right only after right ones
    late = (positions >= budget // 2).expand_as(right)
    assert not right[late].any()  # a useless drafter past the switch: every draft wrong
    # Before it: the first draft of a round is right with chance 0.9, each next one given those.
    first = right[..., : budget // 2, :, 0]
    assert 0.5 < first.float().mean() < 1.0
    early = (positions < budget // 2).expand_as(right)
    after_right = right[..., :-1] & early[..., 1:]
    share = right[..., 1:][after_right].float().mean()
    assert 0.5 < share < 1.0


def test_mixed_rows_keep_the_drafts_of_even_rows_and_none_of_odd_ones() -> None:
    right, _, _ = drawn("mixed rows", 6, 24, 20)
    assert not right[:, :, 1::2].any()
    for row in range(0, 6, 2):
        assert 0.5 < right[:, :, row, 0].float().mean() < 1.0, row


def test_the_oracle_takes_one_of_tau_and_scenario() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError):
        AcceptanceOracle({}, None, BLOCK, 1, 10, cpu)
    with pytest.raises(ValueError):
        AcceptanceOracle({}, 3.0, BLOCK, 1, 10, cpu, scenario="collapse")
