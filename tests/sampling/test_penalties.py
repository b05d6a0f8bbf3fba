"""The logit controls (presence, frequency and repetition penalties, min_tokens, logit_bias,
min_p): the processing against transformers' own processors, the sampler's distribution with
them, and the engine: lossless with a draft, after preemption, and against generate()."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3ForCausalLM
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from batchrun.bench.hooks import BenchHooks
from batchrun.bench.oracle import AcceptanceOracle
from batchrun.engine.core.requests import Request, RequestOutput
from batchrun.sampling.control_state import ControlState
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.penalties import VerifyRows, apply_controls
from batchrun.sampling.sampler import SamplingBatch, filter_candidates, sample
from tests.helpers.dflash_train import trained_draft_beside, training_prompts
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end
from tests.sampling.test_sampler import REJECT_P, N, chi_square_p_value, distinct

pytestmark = pytest.mark.usefixtures("one_thread_module")
VOCAB = 24
EOS = 2  # <|im_end|> of the tiny tokenizer


def controlled_rows(
    reqs: list[Request], eos: frozenset[int] = frozenset()
) -> tuple[ControlState, torch.Tensor]:
    """The requests admitted to slots 0 .. n-1 of a ControlState; their rows' controls."""
    state = ControlState(len(reqs), VOCAB, torch.device("cpu"))
    state.eos_ids = eos
    slots = torch.arange(len(reqs))
    state.admit(reqs, slots)
    return state, slots


def hf_processed(logits: torch.Tensor, req: Request, eos: int) -> torch.Tensor:
    """One row through transformers' processors in vLLM's order, presence and frequency by
    hand (transformers has none)."""
    p = req.params
    ids = torch.tensor([req.prompt_ids + req.output.token_ids])
    scores = logits[None].clone()
    if p.logit_bias:
        bias = {(t,): b for t, b in p.logit_bias}
        scores = SequenceBiasLogitsProcessor(bias)(ids, scores)
    if p.min_tokens:
        stop = [eos, *p.stop_token_ids]
        min_new = MinNewTokensLengthLogitsProcessor(len(req.prompt_ids), p.min_tokens, stop)
        scores = min_new(ids, scores)
    scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(req.output.token_ids, dtype=torch.long), minlength=VOCAB)
    return (scores[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)).float()


CONTROLS = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.4),
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3),
    SamplingParams(min_tokens=5, stop_token_ids=(7,)),
    SamplingParams(min_tokens=2),  # its output holds 3 tokens: nothing masked
    SamplingParams(logit_bias=((3, 100.0), (5, -7.5), (23, 0.25))),
    SamplingParams(logit_bias=((4, -100.0),), min_tokens=9, repetition_penalty=2.0),
    SamplingParams(),
]


def random_requests(params: list[SamplingParams], seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Request(
            i,
            torch.randint(0, VOCAB, (6,), generator=gen).tolist(),
            p,
            output=RequestOutput(torch.randint(0, VOCAB, (3,), generator=gen).tolist()),
        )
        for i, p in enumerate(params)
    ]


def test_controls_are_transformers_processors() -> None:
    reqs = random_requests(CONTROLS, seed=1)
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    state, slots = controlled_rows(reqs, eos=frozenset({EOS}))
    steps = torch.tensor([len(r.output.token_ids) for r in reqs])
    controls = state.rows(slots, steps)
    assert controls is not None
    got = apply_controls(logits.clone(), controls)
    for row, req in enumerate(reqs):
        expected = hf_processed(logits[row], req, EOS)
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6, msg=str(req.params))
    assert not torch.equal(got[:-1], logits[:-1])  # every control changed its row
    assert torch.equal(got[-1], logits[-1])


def test_min_p_is_transformers_warper() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    for min_p in (0.05, 0.2, 0.5, 1.0):
        values, ids = filter_candidates(
            logits.clone(), torch.zeros(8, dtype=torch.long), torch.ones(8), torch.full((8,), min_p)
        )
        kept = torch.full_like(logits, float("-inf")).scatter_(1, ids, values)
        expected = MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(kept, expected), min_p


def test_verify_rows_count_the_drafts_before_them() -> None:
    """Row j of a verify block samples after drafts d1 .. dj: the same logits as applying the
    controls to a request whose output already holds them."""
    width = 4
    params = [
        SamplingParams(
            presence_penalty=0.7,
            frequency_penalty=0.9,
            repetition_penalty=1.6,
            logit_bias=((6, 2.0),),
            min_tokens=6,
        )
    ] * 2
    reqs = random_requests(params, seed=5)
    drafts = torch.tensor([[6, 6, 9], [reqs[1].output.token_ids[0], 11, 6]])  # repeats, seen ids
    logits = torch.randn(2 * width, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    state, slots = controlled_rows(reqs, eos=frozenset({EOS}))
    row_slot = slots.repeat_interleave(width)
    steps = torch.tensor([len(r.output.token_ids) + j for r in reqs for j in range(width)])
    controls = state.rows(row_slot, steps)
    assert controls is not None
    verify = VerifyRows(drafts, torch.tensor([width, width]), 2 * width)
    got = apply_controls(logits.clone(), controls, verify)
    for r, req in enumerate(reqs):
        for j in range(width):
            grown_ids = req.output.token_ids + drafts[r, :j].tolist()
            grown = Request(0, req.prompt_ids, req.params, output=RequestOutput(grown_ids))
            expected = hf_processed(logits[r * width + j], grown, EOS)
            torch.testing.assert_close(got[r * width + j], expected, rtol=1e-6, atol=1e-6)


# -- the sampler's distribution with the controls --------------------------------------------

LOGITS = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.5),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1.3, frequency_penalty=0.6, min_p=0.2, top_k=12),
        SamplingParams(temperature=1.0, min_p=0.1, top_p=0.9, logit_bias=((0, 3.0),)),
    ],
    ids=["repetition-presence", "min-p", "frequency-min-p-top-k", "min-p-top-p-bias"],
)
def test_sampled_rows_follow_the_processed_distribution(params: SamplingParams) -> None:
    req = Request(0, [1, 4, 4, 9], params, output=RequestOutput([4, 0, 7, 7]))
    state, _ = controlled_rows([req])
    count = torch.arange(N, dtype=torch.int64)
    controls = state.rows(torch.zeros(N, dtype=torch.long), torch.full((N,), 4))
    logits = LOGITS.float().expand(N, VOCAB).contiguous()
    if controls is not None:  # None: no penalty (min_p alone is the sampler's)
        logits = apply_controls(logits, controls)
    batch = SamplingBatch(
        temperature=torch.full((N,), params.temperature),
        top_p=torch.full((N,), params.top_p),
        top_k=torch.full((N,), params.top_k, dtype=torch.int64),
        seed=torch.full((N,), 2**40 + 17, dtype=torch.int64),
        step=count,
        min_p=torch.full((N,), params.min_p),
    )
    tokens = sample(logits, batch)

    def reference(processed: torch.Tensor, min_p: float) -> torch.Tensor:
        scores = processed[None].double() / params.temperature
        if min_p:
            scores = MinPLogitsWarper(min_p)(None, scores)
        probs = scores[0].softmax(-1)
        order = probs.argsort(descending=True)
        keep = torch.ones(VOCAB, dtype=torch.bool)
        if params.top_k:
            keep[order[params.top_k :]] = False
        if params.top_p < 1:
            kept = torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum()
            mass_before = kept[order].cumsum(-1) - kept[order]
            keep[order[int((mass_before < params.top_p).sum()) :]] = False
        probs = torch.where(keep, probs, 0.0)
        return probs / probs.sum()

    processed = hf_processed(LOGITS.float(), req, EOS)
    assert chi_square_p_value(tokens, reference(processed, params.min_p)) > REJECT_P
    # The draws tell the controls apart: without the penalties, or without min_p, they fail.
    assert chi_square_p_value(tokens, reference(LOGITS.float(), params.min_p)) < REJECT_P or (
        not params.controlled
    )
    without_min_p = reference(processed, 0.0)
    if distinct(without_min_p, reference(processed, params.min_p)):
        assert chi_square_p_value(tokens, without_min_p) < REJECT_P


# -- the engine --------------------------------------------------------------------------------

ENGINE_CONTROLS = {
    "repetition": {"repetition_penalty": 1.8},
    "presence-frequency": {"presence_penalty": 1.2, "frequency_penalty": 0.8},
    # The end-of-sequence id pushed up, so that rows stop early unless min_tokens holds them.
    "min-tokens": {"min_tokens": 12, "logit_bias": ((EOS, 100.0),)},
    "logit-bias": {"logit_bias": ((9, 4.0), (EOS, -100.0))},
    "all": {
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "min_tokens": 5,
        "logit_bias": ((9, 2.0),),
    },
}


def run(
    target: Path,
    draft: Path | None,
    jobs: list[tuple[list[int], SamplingParams]],
    truth: list[Request] | None = None,
    **config: Any,
) -> list[Request]:
    """The finished requests. truth: the outputs of a run without a draft, which an acceptance
    oracle then drafts (most of each block right, the rest wrong), so that verify rows past the
    first sample with drafts among their counts; the outputs must not change."""
    engine = cpu_engine(target, draft, **config)
    engine.instruments.rounds = []
    if truth is not None:
        block = engine.block_size
        assert block is not None
        continuations = {r.row_index: r.output.token_ids for r in truth}
        oracle = AcceptanceOracle(
            continuations, 0.8 * block, block, len(jobs), engine.vocab_size, engine.device
        )
        engine.speculator.hooks = BenchHooks(oracle=oracle)
    done = run_to_end(engine, requests_of(jobs))
    if truth is not None:
        assert sum(len(t.committed) > 2 for t in engine.instruments.rounds) >= len(jobs) // 2
    return done


@pytest.fixture(scope="module")
def trained(target: Path) -> Path:
    return trained_draft_beside(target)


def jobs_with(
    controls: dict[str, Any], max_tokens: int = 24
) -> list[tuple[list[int], SamplingParams]]:
    prompts = training_prompts(seed=0)[:6] + [[5, 9, 5, 9, 5], [300, 301]]
    return [(p, SamplingParams(max_tokens=max_tokens, **controls)) for p in prompts]


@pytest.mark.parametrize("name", list(ENGINE_CONTROLS))
def test_greedy_with_a_draft_is_lossless_and_controls_change_it(
    target: Path, trained: Path, name: str
) -> None:
    jobs = jobs_with(ENGINE_CONTROLS[name])
    plain = run(target, None, jobs)
    spec = run(target, trained, jobs, truth=plain)
    assert [r.output.token_ids for r in spec] == [r.output.token_ids for r in plain]
    without = {k: v for k, v in ENGINE_CONTROLS[name].items() if k == "logit_bias"}
    off = run(target, None, jobs_with(without if name == "min-tokens" else {}))
    assert [r.output.token_ids for r in plain] != [r.output.token_ids for r in off]


def test_sampled_with_a_draft_is_lossless(target: Path, trained: Path) -> None:
    controls = {
        "temperature": 0.1,
        "repetition_penalty": 1.4,
        "presence_penalty": 0.5,
        "min_p": 0.1,
        "min_tokens": 4,
    }
    jobs = [(p, replace(ps, seed=7 + i, **controls)) for i, (p, ps) in enumerate(jobs_with({}))]
    plain = run(target, None, jobs)
    spec = run(target, trained, jobs, truth=plain)
    assert [r.output.token_ids for r in spec] == [r.output.token_ids for r in plain]


def test_min_tokens_holds_back_every_stop(target: Path) -> None:
    """The end-of-sequence id, banned by a bias elsewhere, ends rows at once; min_tokens holds
    it, a stop id and a stop string back (not the stopper: the mask)."""
    eos_first = {"logit_bias": ((EOS, 100.0),)}
    assert all(len(r.output.token_ids) == 1 for r in run(target, None, jobs_with(eos_first)))
    held = run(target, None, jobs_with(eos_first | {"min_tokens": 7}))
    assert all(
        r.output.token_ids[:7].count(EOS) == 0 and len(r.output.token_ids) == 8 for r in held
    )
    assert all(r.output.finish_reason == "stop" for r in held)


@cache
def hf_model(model_dir: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize(
    ("controls", "generate_args"),
    [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"min_tokens": 10}, {"min_new_tokens": 10}),
        ({"logit_bias": ((9, 3.0), (17, -1.0))}, {"sequence_bias": {(9,): 3.0, (17,): -1.0}}),
    ],
    ids=["repetition", "min-tokens", "logit-bias"],
)
def test_greedy_equals_generate(
    target: Path, controls: dict[str, Any], generate_args: dict[str, Any]
) -> None:
    jobs = jobs_with(controls, max_tokens=16)
    model = hf_model(target)
    for req, (prompt, _) in zip(run(target, None, jobs), jobs, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=0,
                **generate_args,
            )
        assert req.output.token_ids == out[0, len(prompt) :].tolist(), controls


def test_preemption_keeps_the_counts(target: Path, trained: Path) -> None:
    jobs = jobs_with(ENGINE_CONTROLS["all"], max_tokens=30)
    roomy = run(target, None, jobs)
    for draft in (None, trained):
        engine = cpu_engine(target, draft, num_pages=40)
        tight = run_to_end(engine, requests_of(jobs))
        assert engine.num_preemptions > 0
        assert [r.output.token_ids for r in tight] == [r.output.token_ids for r in roomy]
