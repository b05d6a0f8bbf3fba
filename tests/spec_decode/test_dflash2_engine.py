"""The engine's DFlash2 path (float32, CPU) against target-only decoding and the plain
reference (tests/helpers/dflash2_reference.py): greedy output token-identical to the engine
without a draft, every round drafting exactly the reference's walk and committing what it
commits, the speculation statistics adding up; seeded sampling unchanged by the draft. Bad
DFlash2 drafts are refused in one line when the engine starts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.dflash2.speculator import DFlash2Speculator
from tests.helpers.dflash2_models import make_tiny_dflash2
from tests.helpers.dflash2_reference import block_logits, propose, read_draft2, reference_generate2
from tests.helpers.dflash2_train import trained_dflash2_beside
from tests.helpers.dflash_reference import load_target, target_pass
from tests.helpers.dflash_train import CONTINUATION, training_prompts
from tests.spec_decode.test_dflash_engine import (
    EOS,
    MAX_TOKENS,
    Job,
    check_same_outputs,
    check_stats,
    chi_square_p_value,
    exact_top_k_probs,
    greedy_jobs,
    random_prompts,
    rounds_of,
    run,
)

pytestmark = pytest.mark.usefixtures("one_thread_module")

KINDS: dict[str, dict[str, Any]] = {
    "random": {"num_layers": 2, "target_layer_ids": [1, 2]},
    # A wide block, default feature layers, no softcapping or multiplier.
    "b8-plain-head": {
        "block_size": 8,
        "keys": {"final_logit_softcapping": None, "output_multiplier": None},
    },
    # Sliding layers over 6 positions, non-causal in the block (the published drafters').
    "sliding": {"num_layers": 2, "target_layer_ids": [1, 2], "sliding_window": 6},
    # The selector over all but few candidates, groups of 32 channels.
    "wide-selector": {"keys": {"selector_top_k": 32, "conv_group_size": 32}, "seed": 4},
    "trained": {},  # trained_dflash2_beside's
}


@pytest.fixture(scope="module")
def draft_for(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind == "trained":
            return trained_dflash2_beside(target)
        if kind not in made:
            out = tmp_path_factory.mktemp("dflash2")
            made[kind] = make_tiny_dflash2(out, target, **{"seed": 1, **KINDS[kind]})
        return made[kind]

    return make


def check_against_reference(
    target: Path, draft: Path, jobs: list[Job], engine: Engine, finished: list[Request]
) -> None:
    assert engine.block_size is not None
    for i, ((prompt, params), req) in enumerate(zip(jobs, finished, strict=True)):
        out, ref_rounds = reference_generate2(target, draft, prompt, params.max_tokens, [EOS])
        got = rounds_of(engine, i)
        assert req.output.token_ids == out, f"row {i}"
        for j, (a, b) in enumerate(zip(got, ref_rounds, strict=False)):
            assert a == b, f"row {i} round {j}: engine {a} != reference {b}"
        assert len(got) == len(ref_rounds), f"row {i}"
        check_stats(req, engine.block_size, got)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_equals_target_only_and_reference(
    target: Path, draft_for: Callable[[str], Path], kind: str
) -> None:
    draft = draft_for(kind)
    if kind == "trained":
        jobs = greedy_jobs(training_prompts(seed=0), [CONTINUATION, 3, 17, 1, 26, 9, 40, 30])
    else:
        jobs = greedy_jobs(random_prompts(seed=0), MAX_TOKENS)
    engine, spec = run(target, draft, jobs)
    assert isinstance(engine.worker.speculator, DFlash2Speculator)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    check_against_reference(target, draft, jobs, engine, spec)
    if kind == "trained":  # accepted often, not always: the commit paths of every length ran
        lengths = Counter(len(t.committed) for t in engine.instruments.rounds or [])
        assert len(lengths) >= 3, lengths


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_seeded_sampling_reproduces(
    target: Path, draft_for: Callable[[str], Path], temperature: float
) -> None:
    """A sampled request walks by sampling and its verify samples against the walk's q: the
    same seeds give the same outputs, however the batch is made up, and the statistics add up."""
    jobs = [
        (p, SamplingParams(max_tokens=20, seed=50 + i, temperature=temperature))
        for i, p in enumerate(random_prompts(seed=5))
    ]
    engine, first = run(target, draft_for("trained"), jobs)
    _, again = run(target, draft_for("trained"), jobs[::-1], max_batch_size=3)
    check_same_outputs(first, again[::-1])
    assert engine.block_size is not None
    for req in first:
        check_stats(req, engine.block_size, rounds_of(engine, req.row_index))


def test_sampling_distribution_matches_target(
    target: Path, draft_for: Callable[[str], Path]
) -> None:
    """Over many seeds at temperature 1, the first four tokens (the prefill's, then verify rounds
    that often accept sampled drafts) follow the target's exact top-2 distribution."""
    depth, k, n = 4, 2, 800
    draft = draft_for("trained")
    # The prompt whose greedy continuation the drafter predicts best from its first round.
    firsts = {
        i: len(reference_generate2(target, draft, p, depth, [EOS])[1][0].committed)
        for i, p in enumerate(training_prompts(seed=0))
    }
    prompt = training_prompts(seed=0)[max(firsts, key=firsts.__getitem__)]
    jobs = [
        (prompt, SamplingParams(max_tokens=depth, temperature=1.0, top_k=k, seed=s))
        for s in range(n)
    ]
    wide = {"max_batch_size": 64, "max_batched_tokens": 512, "num_pages": 512}
    engine, spec = run(target, draft, jobs, **wide)
    multi = sum(len(t.committed) > 1 for t in engine.instruments.rounds or [])
    assert multi >= n // 10, multi  # many samples came out of accepted drafts
    expected = exact_top_k_probs(target, prompt, depth, k)
    counts = Counter(tuple(r.output.token_ids) for r in spec)
    assert set(counts) <= set(expected)
    p_value = chi_square_p_value(counts, expected, n)
    assert p_value > 1e-3, (p_value, counts.most_common(), expected)


def test_the_walk_is_no_argmax(target: Path, draft_for: Callable[[str], Path]) -> None:
    """The random drafters' selector changes the reference's drafts from the head's argmax, so
    the tests above tell a speculator that walks from one that does not."""
    sequence = random_prompts(seed=9, lengths=[40])[0]
    for kind in ("random", "sliding"):
        draft = read_draft2(draft_for(kind))
        _, feats = target_pass(load_target(target), sequence, draft.base.target_layer_ids)
        differ = 0
        for p in range(5, 35, 3):
            anchor = torch.tensor(sequence[p])
            with torch.no_grad():
                logits, _ = block_logits(draft, load_target(target), feats[:p], anchor)
            walked = propose(draft, load_target(target), feats[:p], sequence[p])
            differ += walked != logits.argmax(-1).tolist()
        assert differ >= 3, kind


def test_the_width_policy_runs_unchanged(target: Path, draft_for: Callable[[str], Path]) -> None:
    """verify_width auto over the trained drafter: DFlash's policy chooses among its widths
    from the rounds' acceptance, the output stays the target's."""
    jobs = greedy_jobs(training_prompts(seed=0), [CONTINUATION] * 8)
    engine, spec = run(target, draft_for("trained"), jobs, verify_width="auto")
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    widths = engine.worker.speculator.info()["verify_width_steps"]
    assert widths and any(w > 1 for w in widths), widths
