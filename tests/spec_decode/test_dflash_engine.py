"""The engine's DFlash path against target-only decoding and against the plain reference.

Float32 on the CPU: speculative greedy output must be token-identical to the engine without a
draft, every verify round must draft exactly the reference's tokens, the speculation statistics
must add up, and sampling must not change the output (the sampler is keyed by seed and token
index, so even individual samples match). So for every kind of draft: z-lab's, with
sliding-window layers (causal or not in the block), causal full layers, a reduced vocabulary,
and the speculators format. Bad drafts are refused, by name, when the engine starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.errors import JobError
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from batchrun.spec_decode.width_policy import WidthPolicy
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.dflash_reference import (
    RefRound,
    load_target,
    reference_drafts,
    reference_generate,
)
from tests.helpers.dflash_train import CONTINUATION, trained_draft_beside, training_prompts
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end

MakeModel = Callable[..., Path]
Job = tuple[list[int], SamplingParams]

pytestmark = pytest.mark.usefixtures("one_thread_module")  # module fixtures (drafts) too
EOS = 2  # <|im_end|> of the tiny tokenizer
PROMPT_LENGTHS = [1, 2, 5, 9, 16, 23, 37, 11]
MAX_TOKENS = [20, 7, 13, 1, 24, 9, 18, 30]


@pytest.fixture(scope="module")
def trained(target: Path) -> Path:
    return trained_draft_beside(target)


@pytest.fixture(scope="module")
def draft_for(
    make_model: MakeModel, target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    """kind -> (target dir, draft dir)."""
    kinds: dict[str, Callable[[], tuple[Path, Path]]] = {
        "random": lambda: (target, draft(target, num_layers=2, target_layer_ids=[1, 2])),
        # Default layer ids ([2] for n=1, N=4) and a wide block.
        "random-b8-default-ids": lambda: (target, draft(target, block_size=8)),
        # Tied target; default ids for n=2, N=3 are [1, 0]: features out of layer order.
        "tied-3-layers": lambda: (
            make_model(num_layers=3),
            draft(make_model(num_layers=3), num_layers=2, block_size=5, seed=3),
        ),
        # The last layer's feature is its pre-norm output, not HF's (normed) last hidden state.
        "random-last-layer": lambda: (target, draft(target, target_layer_ids=[0, 3], seed=2)),
        # A full layer, then one sliding over 6 positions, causal in the block (z-lab's rule).
        "sliding": lambda: (target, draft(target, sliding_window=6, sliding_layers=[1], **TWO)),
        # Every layer sliding over 5, non-causal (dflash_config.causal: false).
        "sliding-noncausal": lambda: (
            target,
            draft(target, sliding_window=5, **TWO, extra_config=dflash_config(causal=False)),
        ),
        # Full layers, causal in the block (dflash_config.causal: true).
        "causal": lambda: (target, draft(target, **TWO, extra_config=dflash_config(causal=True))),
        # A reduced vocabulary: every third target id (d2t, no t2d).
        "vocab": lambda: (target, draft(target, draft_vocab=THIRDS, drop=("t2d",))),
        # The speculators format (aux ids [2, 3]); and with a sliding first layer, a reduced
        # vocabulary (d2t and t2d) and a non-causal window.
        "speculators": lambda: (target, draft(target, speculators=True, **TWO)),
        "speculators-sliding-vocab": lambda: (
            target,
            draft(
                target,
                speculators=True,
                sliding_window=7,
                sliding_layers=[0],
                **TWO,
                draft_vocab=list(range(3, 900, 2)),
                extra_config={"sliding_window_non_causal": True},
            ),
        ),
        "trained": lambda: (target, trained_draft_beside(target)),
        "trained-sliding": lambda: (target, trained_draft_beside(target, "sliding")),
        "trained-speculators-vocab": lambda: (
            target,
            trained_draft_beside(target, "speculators-vocab"),
        ),
    }

    def draft(target_dir: Path, drop: tuple[str, ...] = (), **kw: Any) -> Path:
        out = make_tiny_draft(tmp_path_factory.mktemp("draft"), target_dir, **{"seed": 1, **kw})
        if drop:
            weights = load_file(str(out / "model.safetensors"))
            save_file(
                {k: v for k, v in weights.items() if k not in drop}, str(out / "model.safetensors")
            )
        return out

    return lambda kind: kinds[kind]()


TWO = {"num_layers": 2, "target_layer_ids": [1, 2]}
THIRDS = list(range(0, 1088, 3))  # a reduced vocabulary: every third target id


def dflash_config(**keys: Any) -> dict[str, Any]:
    return {"dflash_config": {"mask_token_id": 1024, "target_layer_ids": [1, 2], **keys}}


TRAINED = ["trained", "trained-sliding", "trained-speculators-vocab"]
VARIANTS = [
    "sliding",
    "sliding-noncausal",
    "causal",
    "vocab",
    "speculators",
    "speculators-sliding-vocab",
]


def run(
    target: Path, draft: Path | None, jobs: list[Job], **config: Any
) -> tuple[Engine, list[Request]]:
    """Every job through one engine: finished requests in row order; rounds recorded."""
    settings: dict[str, Any] = {
        "max_batch_size": 8,
        "max_batched_tokens": 64,
        "num_pages": 64,
        "verify_width": "full",
    }
    settings |= config
    engine = cpu_engine(target, draft, cuda_graphs=False, **settings)
    engine.instruments.rounds = []
    finished = run_to_end(engine, requests_of(jobs))
    assert len(finished) == len(jobs)
    return engine, finished


def random_prompts(seed: int, lengths: list[int] = PROMPT_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]


def greedy_jobs(prompts: list[list[int]], max_tokens: list[int]) -> list[Job]:
    return [(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens, strict=True)]


def rounds_of(engine: Engine, row: int) -> list[RefRound]:
    assert engine.instruments.rounds is not None
    return [
        RefRound(t.position, t.anchor, list(t.drafts), list(t.committed))
        for t in engine.instruments.rounds
        if t.row_index == row
    ]


def check_stats(req: Request, block_size: int, rounds: list[RefRound]) -> None:
    """The row's speculation counts: rounds that drafted (a width-1 step is plain decoding),
    the tokens each committed, and those whose every verified draft was accepted."""
    hist, capped = req.output.spec_hist, req.output.spec_capped
    assert hist is not None and capped is not None and len(hist) == len(capped) == block_size
    drafted = [r for r in rounds if r.drafts]
    plain = sum(len(r.committed) for r in rounds if not r.drafts)
    assert len(req.output.token_ids) == 1 + plain + sum(k * n for k, n in enumerate(hist, start=1))
    assert req.output.spec_rounds == sum(hist) == len(drafted)
    assert Counter(len(r.committed) for r in drafted) == {
        k: n for k, n in enumerate(hist, start=1) if n
    }
    full = Counter(len(r.committed) for r in drafted if len(r.committed) == len(r.drafts) + 1)
    assert full == {k: n for k, n in enumerate(capped, start=1) if n}


def check_against_reference(
    target: Path, draft: Path, jobs: list[Job], engine: Engine, finished: list[Request]
) -> None:
    """Outputs, and every round's position, anchor, drafts and committed tokens, per request."""
    assert engine.block_size is not None
    for i, ((prompt, params), req) in enumerate(zip(jobs, finished, strict=True)):
        stops = [EOS, *params.stop_token_ids]
        out, ref_rounds = reference_generate(target, draft, prompt, params.max_tokens, stops)
        got = rounds_of(engine, i)
        assert req.output.token_ids == out, f"row {i}"
        for j, (a, b) in enumerate(zip(got, ref_rounds, strict=False)):
            assert a == b, f"row {i} round {j}: engine {a} != reference {b}"
        assert len(got) == len(ref_rounds), f"row {i}"
        check_stats(req, engine.block_size, got)


def check_same_outputs(spec: list[Request], plain: list[Request]) -> None:
    for a, b in zip(spec, plain, strict=True):
        assert a.output.token_ids == b.output.token_ids, f"row {a.row_index}"
        assert (a.output.finish_reason, a.output.completion) == (
            b.output.finish_reason,
            b.output.completion,
        )


@pytest.mark.parametrize(
    "kind",
    ["random", "random-b8-default-ids", "tied-3-layers", "random-last-layer", *VARIANTS, *TRAINED],
)
def test_greedy_equals_target_only_and_reference(
    draft_for: Callable[[str], tuple[Path, Path]], kind: str
) -> None:
    target, draft = draft_for(kind)
    if kind in TRAINED:
        prompts = training_prompts(seed=0)
        jobs = greedy_jobs(prompts, [CONTINUATION, 3, 17, 1, 26, 9, 40, 30])
    else:
        jobs = greedy_jobs(random_prompts(seed=0), MAX_TOKENS)
    engine, spec = run(target, draft, jobs)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    check_against_reference(target, draft, jobs, engine, spec)
    if kind in TRAINED:
        lengths = Counter(len(t.committed) for t in engine.instruments.rounds or [])
        assert len(lengths) >= 3, lengths  # the commit paths of short and long runs both ran


def test_mask_token_that_the_target_also_emits(target: Path, tmp_path: Path) -> None:
    """Outputs are cut by length, never stripped by value: a real token may equal the mask id."""
    jobs = greedy_jobs(random_prompts(seed=11), MAX_TOKENS)
    _, plain = run(target, None, jobs)
    emitted = Counter(t for req in plain for t in req.output.token_ids[1:])
    mask = emitted.most_common(1)[0][0]
    draft = make_tiny_draft(tmp_path / "draft", target, target_layer_ids=[1], mask_token_id=mask)
    engine, spec = run(target, draft, jobs)
    check_same_outputs(spec, plain)
    check_against_reference(target, draft, jobs, engine, spec)


def reference_runs(target: Path, draft: Path) -> list[tuple[list[int], list[int], list[RefRound]]]:
    """(prompt, output, rounds) of the trained draft's prompts, greedy, no stop but eos."""
    return [
        (p, *reference_generate(target, draft, p, CONTINUATION, [EOS]))
        for p in training_prompts(seed=0)
    ]


def inside_accepted_runs(
    runs: list[tuple[list[int], list[int], list[RefRound]]],
) -> Iterator[tuple[int, int, RefRound, int]]:
    """(row, output index, round, k) for every committed token k of a round that follows an
    accepted draft and is followed by more committed tokens of the same round."""
    for row, (prompt, _, rounds) in enumerate(runs):
        for r in rounds:
            for k in range(1, len(r.committed) - 1):
                yield row, r.position + 1 + k - len(prompt), r, k


def stop_jobs(
    runs: list[tuple[list[int], list[int], list[RefRound]]],
    stop_at: Callable[[list[int], int], SamplingParams | None],
) -> list[tuple[Job, RefRound, int]]:
    """Per row, the first cut point inside an accepted run for which stop_at gives parameters
    (None: not usable there): (job, the round it cuts, tokens of that round kept)."""
    chosen: dict[int, tuple[Job, RefRound, int]] = {}
    for row, index, r, k in inside_accepted_runs(runs):
        if row not in chosen and (params := stop_at(runs[row][1], index)):
            chosen[row] = ((runs[row][0], params), r, k + 1)
    return [chosen[row] for row in sorted(chosen)]


def check_cut_rounds(engine: Engine, cases: list[tuple[Job, RefRound, int]]) -> None:
    """Each request's last round is the reference's uncut round, cut to its first `kept`."""
    for row, (_, r, kept) in enumerate(cases):
        last = rounds_of(engine, row)[-1]
        assert last == r._replace(committed=r.committed[:kept]), f"row {row}"


def test_stop_token_inside_an_accepted_run(target: Path, trained: Path) -> None:
    def stop_at(output: list[int], index: int) -> SamplingParams | None:
        if output[index] in output[:index]:
            return None  # it would stop earlier
        return SamplingParams(max_tokens=CONTINUATION, stop_token_ids=(output[index],))

    cases = stop_jobs(reference_runs(target, trained), stop_at)
    assert len(cases) >= 4
    jobs = [job for job, _, _ in cases]
    engine, spec = run(target, trained, jobs)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    check_against_reference(target, trained, jobs, engine, spec)
    check_cut_rounds(engine, cases)
    for req, (_, params) in zip(spec, jobs, strict=True):
        assert (
            req.output.finish_reason == "stop"
            and req.output.token_ids[-1] == params.stop_token_ids[0]
        )


def test_stop_string_inside_an_accepted_run(target: Path, trained: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(target))

    def stop_at(output: list[int], index: int) -> SamplingParams | None:
        piece = str(tok.decode([output[index]], skip_special_tokens=True)).strip()
        if len(piece) < 2 or "\ufffd" in piece:
            return None  # too common, or a partial character
        if piece in str(tok.decode(output[:index], skip_special_tokens=True)):
            return None
        return SamplingParams(max_tokens=CONTINUATION, stop=(piece,))

    cases = stop_jobs(reference_runs(target, trained), stop_at)
    assert len(cases) >= 3
    jobs = [job for job, _, _ in cases]
    engine, spec = run(target, trained, jobs)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    check_cut_rounds(engine, cases)
    assert engine.block_size is not None
    for req, (_, params) in zip(spec, jobs, strict=True):
        assert req.output.finish_reason == "stop" and req.output.completion is not None
        assert params.stop[0] not in req.output.completion
        check_stats(req, engine.block_size, rounds_of(engine, req.row_index))


def test_max_tokens_inside_a_block(target: Path, trained: Path) -> None:
    """One prompt at every max_tokens from 1 to 14: most limits fall inside a round."""
    prompt = training_prompts(seed=0)[0]
    jobs = greedy_jobs([prompt] * 14, list(range(1, 15)))
    engine, spec = run(target, trained, jobs)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    check_against_reference(target, trained, jobs, engine, spec)
    assert spec[0].output.spec_rounds == 0 and spec[0].output.spec_hist == [
        0,
        0,
        0,
        0,
    ]  # prefill token only
    _, uncut = reference_generate(target, trained, prompt, 14, [EOS])
    uncut_at = {r.position: r for r in uncut}
    cut_inside = 0
    for req in spec[1:]:
        last = rounds_of(engine, req.row_index)[-1]
        cut_inside += len(last.committed) < len(uncut_at[last.position].committed)
    assert cut_inside >= 3


@pytest.mark.parametrize("kind", ["random", "trained", "trained-sliding"])
def test_preemption_changes_nothing(
    draft_for: Callable[[str], tuple[Path, Path]], kind: str
) -> None:
    target, draft = draft_for(kind)
    prompts = training_prompts(seed=0) if kind in TRAINED else random_prompts(seed=7)
    jobs = greedy_jobs(prompts, [30] * len(prompts))
    engine, spec = run(target, draft, jobs, num_pages=40)
    assert engine.num_preemptions > 0
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    check_against_reference(target, draft, jobs, engine, spec)


# The tiny target's top logits are close, so only low temperatures or a small top-k keep the
# samples near the greedy continuations that the trained draft knows: its drafts then get
# accepted, and rejected, often enough to exercise both paths.
SAMPLING = [
    {"temperature": 0.03},
    {"temperature": 0.1, "top_p": 0.9},
    {"temperature": 0.5, "top_k": 2},
]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["t0.03", "t0.1-p0.9", "t0.5-k2"])
def test_sampled_outputs_identical_with_and_without_draft(
    target: Path, trained: Path, sampling: dict[str, Any]
) -> None:
    prompts = training_prompts(seed=0) + random_prompts(seed=3, lengths=[4, 19])
    jobs = [
        (p, SamplingParams(max_tokens=24, seed=100 + i, **sampling)) for i, p in enumerate(prompts)
    ]
    engine, spec = run(target, trained, jobs)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    assert engine.block_size is not None
    for req in spec:
        check_stats(req, engine.block_size, rounds_of(engine, req.row_index))
    # The drafts are still argmax, and they are accepted only where they equal the sample.
    assert any(len(t.committed) > 1 for t in engine.instruments.rounds or [])


def exact_top_k_probs(target: Path, prompt: list[int], depth: int, k: int) -> dict[tuple, float]:
    """P(first `depth` output tokens) under top-k sampling at temperature 1, from HF."""
    model = load_target(target)
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(depth):
        grown: dict[tuple, float] = {}
        for prefix, p in probs.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            top = logits.topk(k)
            for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
                grown[(*prefix, token)] = p * q
        probs = grown
    return probs


def chi_square_p_value(counts: Counter, expected: dict[tuple, float], n: int) -> float:
    """Pearson's test; cells expecting fewer than 5 hits are pooled into one."""
    big = [c for c in expected if expected[c] * n >= 5]
    small = [c for c in expected if expected[c] * n < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    means = [expected[c] * n for c in big] + [sum(expected[c] for c in small) * n]
    cells = [(o, e) for o, e in zip(observed, means, strict=True) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(chi2 / 2, dtype=torch.float64)))


def test_sampling_distribution_matches_target(target: Path, trained: Path) -> None:
    """Over many seeds, the first four tokens (the prefill's, then verify rounds that often
    accept drafts) follow the target's exact top-2 distribution at temperature 1."""
    depth, k, n = 4, 2, 800
    # The prompt whose greedy continuation the draft predicts best from its first round.
    runs = reference_runs(target, trained)
    prompt = max(runs, key=lambda run: len(run[2][0].committed))[0]
    jobs = [
        (prompt, SamplingParams(max_tokens=depth, temperature=1.0, top_k=k, seed=s))
        for s in range(n)
    ]
    wide = {"max_batch_size": 64, "max_batched_tokens": 512, "num_pages": 512}
    engine, spec = run(target, trained, jobs, **wide)
    _, plain = run(target, None, jobs, **wide)
    check_same_outputs(spec, plain)
    multi = sum(len(t.committed) > 1 for t in engine.instruments.rounds or [])
    assert multi >= n // 10, multi  # many samples came out of accepted drafts

    expected = exact_top_k_probs(target, prompt, depth, k)
    counts = Counter(tuple(r.output.token_ids) for r in spec)
    assert set(counts) <= set(expected)
    p_value = chi_square_p_value(counts, expected, n)
    assert p_value > 1e-3, (p_value, counts.most_common(), expected)


GOOD_IDS = {"target_layer_ids": [1, 2], "mask_token_id": 1024}
VOCAB = list(range(0, 1088, 2))  # a reduced vocabulary of 544 target ids


def speculators(**config: Any) -> dict[str, Any]:
    return {"speculators": True, "extra_config": config}


BAD_DRAFTS: dict[str, tuple[dict[str, Any], str]] = {
    "hidden-size": ({"extra_config": {"hidden_size": 48}}, r"hidden_size 48"),
    "no-mask-id": ({"extra_config": {"dflash_config": {"target_layer_ids": [1, 2]}}}, "mask"),
    "mask-outside-embedding": ({"mask_token_id": 1088}, r"mask_token_id 1088.*outside"),
    "layer-id-out-of-range": ({"target_layer_ids": [1, 4]}, r"target_layer_ids \[1, 4\] .*0\.\.3"),
    "negative-layer-id": ({"target_layer_ids": [-1, 2]}, "target_layer_ids"),
    "sample-from-anchor": ({"extra_config": {"sample_from_anchor": True}}, "sample_from_anchor"),
    "sample-from-anchor-in-dflash-config": (
        {"extra_config": {"dflash_config": {**GOOD_IDS, "sample_from_anchor": True}}},
        "sample_from_anchor",
    ),
    "other-architecture": (
        {"extra_config": {"architectures": ["Eagle3DraftModel"]}},
        "Eagle3DraftModel",
    ),
    "yarn-without-its-original-context": (
        {"extra_config": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
        "yarn needs original_max_position_embeddings",
    ),
    "longrope-scaling": (
        {"extra_config": {"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}},
        "rope type 'longrope' is not supported",
    ),
    "llama3-without-its-factors": (
        {"extra_config": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}},
        "llama3 needs low_freq_factor",
    ),
    # Sliding windows: transformers reads no window without use_sliding_window.
    "sliding-without-window": (
        {"extra_config": {"layer_types": ["sliding_attention"], "sliding_window": 8}},
        "sliding_attention layers but no window",
    ),
    "window-below-block": ({"sliding_window": 3}, "sliding_window 3 smaller than the block size 4"),
    "unknown-layer-type": (
        {"extra_config": {"layer_types": ["chunked_attention"]}},
        "layer type 'chunked_attention' is not supported",
    ),
    "layer-types-count": (
        {"extra_config": {"layer_types": ["full_attention"] * 2}},
        "layer_types names 2 layers, not 1",
    ),
    # Reduced vocabularies.
    "draft-vocab-without-head": (
        {"extra_config": {"draft_vocab_size": 512}},
        "draft_vocab_size 512 needs the draft's own lm_head",
    ),
    "draft-vocab-above-target": (
        {"extra_config": {"draft_vocab_size": 2000}},
        "draft_vocab_size must be an integer in 1 .. 1088",
    ),
    "no-d2t": ({"draft_vocab": VOCAB, "drop_tensors": ("d2t",)}, "needs the d2t map"),
    "d2t-shape": (
        {"draft_vocab": VOCAB, "extra_tensors": {"d2t": torch.zeros(10, dtype=torch.int64)}},
        r"d2t has shape \[10\], expected \[544\]",
    ),
    "lm-head-shape": (
        {"draft_vocab": VOCAB, "extra_tensors": {"lm_head.weight": torch.zeros(500, 64)}},
        r"lm_head.weight has shape \[500, 64\], expected \[544, 64\]",
    ),
    "d2t-out-of-range": (
        {"draft_vocab": VOCAB, "extra_tensors": {"d2t": torch.full((544,), 600)}},
        "d2t maps draft tokens outside the target's 1088 ids",
    ),
    "t2d-disagrees": (
        {"draft_vocab": VOCAB, "extra_tensors": {"t2d": torch.ones(1088, dtype=torch.bool)}},
        "t2d does not mark the target ids that d2t maps to",
    ),
    # The speculators format.
    "speculators-eagle3": (
        speculators(speculators_model_type="eagle3"),
        "speculators_model_type 'eagle3' is not supported",
    ),
    "speculators-domino": (speculators(projector_type="domino"), "projector_type 'domino'"),
    "speculators-sample-from-anchor": (
        speculators(sample_from_anchor=True),
        "sample_from_anchor: true",
    ),
    "speculators-shift-label": (speculators(shift_label=True), "shift_label: true"),
    "speculators-no-aux-ids": (
        speculators(aux_hidden_state_layer_ids=None),
        "aux_hidden_state_layer_ids is missing",
    ),
    "speculators-aux-id-of-the-embeddings": (
        speculators(aux_hidden_state_layer_ids=[0, 2]),
        r"aux_hidden_state_layer_ids \[0, 2\] must be layers of the target \(1\.\.4\)",
    ),
    "speculators-target-hidden-size": (
        speculators(target_hidden_size=128),
        "target_hidden_size 128 differs",
    ),
    "speculators-llama-layers": (
        speculators(transformer_layer_config={"model_type": "llama"}),
        "transformer_layer_config has model_type 'llama'",
    ),
    "speculators-bad-layers": (
        speculators(transformer_layer_config={"model_type": "qwen3", "hidden_size": "wide"}),
        "transformer_layer_config is not Qwen3's",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DRAFTS))
def test_bad_draft_is_refused(target: Path, tmp_path: Path, case: str) -> None:
    kw, message = BAD_DRAFTS[case]
    kw = {"num_layers": 1, **GOOD_IDS, **kw}
    extra, drop = kw.pop("extra_tensors", {}), kw.pop("drop_tensors", ())
    draft = make_tiny_draft(tmp_path / "draft", target, **kw)
    weights = load_file(str(draft / "model.safetensors")) | extra
    save_file({k: v for k, v in weights.items() if k not in drop}, str(draft / "model.safetensors"))
    with pytest.raises(JobError, match=message):
        run(target, draft, [])


WIDE = "random-b8-default-ids"  # a block of 8


@pytest.mark.parametrize(
    ("kind", "width"),
    [
        (WIDE, 1),
        (WIDE, 2),
        (WIDE, 5),
        (WIDE, "full"),
        (WIDE, "auto"),
        ("trained", 2),
        ("trained", "full"),
        ("trained", "auto"),
        ("trained-sliding", 2),
        ("trained-sliding", "auto"),
    ],
)
def test_every_verify_width_is_lossless(
    draft_for: Callable[[str], tuple[Path, Path]],
    kind: str,
    width: int | str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy outputs at fixed widths 1, 2, 5 and B, and under the adaptive policy, equal
    target-only's; a round of width w commits 1 .. w tokens, counted in B histogram bins, and
    drafts what the reference drafts from the same context (a sliding draft's window filled,
    at width 1, by the target's own steps). The policy's drafter is kept awake: a dormant one
    drafts from a context with holes by design (test_a_dormant_drafter_writes_nothing_and_
    changes_nothing)."""
    monkeypatch.setattr(WidthPolicy, "dormant", property(lambda _: False))
    target, draft = draft_for(kind)
    if kind in TRAINED:
        jobs = greedy_jobs(training_prompts(seed=0), [CONTINUATION, 3, 17, 1, 26, 9, 40, 30])
    else:
        jobs = greedy_jobs(random_prompts(seed=0), MAX_TOKENS)
    engine, spec = run(target, draft, jobs, verify_width=width)
    _, plain = run(target, None, jobs)
    check_same_outputs(spec, plain)
    block = engine.block_size
    assert block is not None
    widest = block if width in ("full", "auto") else int(width)
    for req, (prompt, _) in zip(spec, jobs, strict=True):
        rounds = rounds_of(engine, req.row_index)
        check_stats(req, block, rounds)
        assert req.output.spec_hist is not None and not any(req.output.spec_hist[widest:])
        drafted = [r for r in rounds if r.drafts]
        sequence = prompt + req.output.token_ids
        expected = reference_drafts(target, draft, sequence, [r.position for r in drafted])
        for r in drafted:
            assert r.anchor == sequence[r.position]
            assert r.drafts == expected[r.position][: len(r.drafts)], (req.row_index, r)
    if kind in TRAINED and width != "auto":  # the trained draft fills a round of any width
        assert max(len(t.committed) for t in engine.instruments.rounds or []) == widest
    if width == "auto":  # width 1 and a drafting width were measured; the policy saw acceptance
        policy = engine.speculator.policy
        assert isinstance(engine.speculator, DFlashSpeculator) and policy is not None
        measured = {w for w, _ in policy.samples}
        assert measured <= set(engine.speculator.widths) and 1 in measured and len(measured) > 1
        assert sum(policy.trials) > 0


def test_a_verify_width_beyond_the_block_is_refused(
    draft_for: Callable[[str], tuple[Path, Path]],
) -> None:
    target, draft = draft_for(WIDE)
    with pytest.raises(JobError, match="verify width must be auto, full or 1 .. 8"):
        run(target, draft, [], verify_width=9)


def test_a_dormant_drafter_writes_nothing_and_changes_nothing(
    draft_for: Callable[[str], tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafter that accepts nothing: once dormant, width-1 steps (graph replays and eager
    steps alike) capture no features and the draft's context is not written; greedy outputs
    still equal target-only's."""
    from batchrun.engine.model_runner import ModelRunner

    target, draft = draft_for("random")
    captures: list[bool] = []
    forward = ModelRunner._forward

    def spied(
        self: ModelRunner, inputs: Any, store_context: bool, capture: bool = True, **kw: Any
    ) -> Any:
        captures.append(capture)
        return forward(self, inputs, store_context, capture, **kw)

    monkeypatch.setattr(ModelRunner, "_forward", spied)
    stored: list[int] = []
    store = DFlashSpeculator.store_context
    monkeypatch.setattr(
        DFlashSpeculator,
        "store_context",
        lambda self, features, rows: (stored.append(len(captures)), store(self, features, rows)),
    )
    lengths = [3 + (7 * i) % 29 for i in range(40)]
    jobs = greedy_jobs(random_prompts(seed=5, lengths=lengths), [60] * 40)
    sizes: dict[str, Any] = dict(max_batch_size=32, max_batched_tokens=512, num_pages=1200)
    # Graphs (emulated off a GPU): decode-only steps replay them, the quiet ones included.
    engine = cpu_engine(target, draft, verify_width="auto", **sizes)
    engine.capture_graphs()
    captures.clear()  # the captures
    spec = run_to_end(engine, requests_of(jobs))
    _, plain = run(target, None, jobs, **sizes)
    check_same_outputs(sorted(spec, key=lambda r: r.row_index), plain)
    assert False in captures  # it went dormant
    quiet = captures.index(False)  # the first step that captured nothing: dormant from here
    assert quiet < len(captures) // 2, (quiet, len(captures))  # early in the job
    # It sleeps until a probe is due (a share of the time that depends on the machine's step
    # times), then writes its context again: while asleep nothing was stored.
    woke = captures.index(True, quiet) if True in captures[quiet:] else len(captures)
    assert not [s for s in stored if quiet < s <= woke], (quiet, woke)
    assert any(name == "target1-quiet" for name, _ in engine.runner.replays)
