"""Greedy outputs of the engine are token-identical to transformers' generate() on the same
checkpoint: float32 on the CPU, one prompt at a time in generate(), mixed batches in the engine.

The tiny checkpoints are initialised so that top-1/top-2 logit gaps sit far above float32 noise
(see batchrun/tools/tiny.py); a mismatch message shows generate()'s gap where the two diverge,
so a genuine near-tie can be told from an engine bug.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams
from batchrun.tools.bpe import split_files

MakeModel = Callable[..., Path]

# Mixed lengths, a one-token prompt and a repeated prompt among them; longer than the chunked
# prefill budgets used below.
PROMPT_LENGTHS = [1, 2, 5, 9, 16, 23, 37, 50, 9, 30]
MAX_TOKENS = [20, 12, 24, 16, 20, 8, 20, 16, 20, 18]

SHAPES = {
    "gqa2-tied": {},
    "mha-untied-2shards": {"num_kv_heads": 4, "tie_word_embeddings": False, "num_shards": 2},
    "gqa4-3layers-3shards": {"num_kv_heads": 1, "num_layers": 3, "num_shards": 3},
    "narrow-hidden-padded-vocab": {
        "hidden_size": 48,  # != heads * head_dim (64), as Qwen3 allows
        "vocab_size": 1088,  # rows past the tokenizer, as real Qwen checkpoints have
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class Case:
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()


@cache
def prompts(model_dir: Path) -> list[tuple[int, ...]]:
    """Token ids of held-out standard-library source, cut to PROMPT_LENGTHS."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    files = split_files()[1]
    out = []
    for i, n in enumerate(PROMPT_LENGTHS):
        # Prompt 8 repeats prompt 3 (same file, same length) to check duplicates in a batch.
        ids = tok.encode(files[3 if i == 8 else i].read_text(encoding="utf-8")[:4000])
        out.append(tuple(ids[:n]))
    return out


def cases(model_dir: Path) -> list[Case]:
    return [Case(p, m) for p, m in zip(prompts(model_dir), MAX_TOKENS, strict=True)]


@cache
def hf_model(model_dir: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@cache
def hf_greedy(
    model_dir: Path, prompt: tuple[int, ...], max_new: int
) -> tuple[list[int], list[float]]:
    """generate()'s greedy tokens (eos from generation_config.json, included when hit) and the
    top-1/top-2 logit gap at each step."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        output_scores=True,
        return_dict_in_generate=True,
    )
    gaps = []
    for scores in out.scores:
        top2 = scores[0].topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(prompt) :].tolist(), gaps


def eos_ids(model_dir: Path) -> set[int]:
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {eos}


def expected(
    model_dir: Path, case: Case, max_model_len: int = 10**9
) -> tuple[list[int], str, list[float]]:
    """What the engine must return: generate()'s tokens cut at the first stop token, why it
    finished, and generate()'s logit gaps."""
    max_new = min(case.max_tokens, max_model_len - len(case.prompt))
    tokens, gaps = hf_greedy(model_dir, case.prompt, max_new)
    stops = eos_ids(model_dir) | set(case.stop_token_ids)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], "stop", gaps
    assert len(tokens) == max_new
    return tokens, "length", gaps


def run_engine(
    model_dir: Path, batch: list[Case], **overrides: Any
) -> tuple[list[Request], Engine]:
    settings: dict[str, Any] = {
        "max_batch_size": 8,
        "max_batched_tokens": 64,
        "page_size": 4,
        "num_pages": 64,
    } | overrides
    engine = Engine(
        EngineConfig(
            target=model_dir,
            device="cpu",
            dtype="float32",
            attention_backend="torch",
            cuda_graphs=False,
            **settings,
        )
    )
    requests = [
        Request(
            row_index=i,
            prompt_ids=list(c.prompt),
            params=SamplingParams(max_tokens=c.max_tokens, stop_token_ids=c.stop_token_ids),
        )
        for i, c in enumerate(batch)
    ]
    for req in requests:
        engine.add(req)
    finished: list[Request] = []
    for _ in range(10_000):
        if not engine.num_unfinished:
            break
        finished += engine.step()
    assert engine.num_unfinished == 0, "the engine did not finish"
    assert sorted(r.row_index for r in finished) == list(range(len(batch)))
    return requests, engine


def assert_matches(
    model_dir: Path, batch: list[Case], requests: list[Request], max_model_len: int = 10**9
) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for case, req in zip(batch, requests, strict=True):
        want, reason, gaps = expected(model_dir, case, max_model_len)
        where = f"row {req.row_index} (prompt length {len(case.prompt)})"
        if req.output.token_ids != want:
            at = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(req.output.token_ids, want, strict=False))
                    if a != b
                ),
                min(len(req.output.token_ids), len(want)),
            )
            gap = f"{gaps[at]:.2e}" if at < len(gaps) else "n/a"
            pytest.fail(
                f"{where}: first difference at output position {at} (generate()'s top-1/top-2 "
                f"gap there: {gap})\n engine:   {req.output.token_ids}\n generate: {want}"
            )
        assert req.output.finish_reason == reason, where
        # The token that stopped a request ends the text without being part of it.
        text_ids = want[:-1] if reason == "stop" else want
        assert req.output.completion == tok.decode(text_ids, skip_special_tokens=True), where


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_mixed_batch_matches_generate(make_model: MakeModel, shape: dict[str, Any]) -> None:
    path = make_model(**shape)
    batch = cases(path)
    requests, _ = run_engine(path, batch)
    assert_matches(path, batch, requests)


@pytest.mark.parametrize("shape", ["gqa2-tied", "gqa4-3layers-3shards"])
def test_chunked_prefill_matches_generate(make_model: MakeModel, shape: str) -> None:
    path = make_model(**SHAPES[shape])
    batch = cases(path)
    assert max(len(c.prompt) for c in batch) > 3 * 13
    # 13 tokens a forward: long prompts take several chunks, and chunks share forwards with
    # other requests' decode rows. Fewer slots than requests keep some waiting.
    requests, _ = run_engine(path, batch, max_batched_tokens=13, max_batch_size=3)
    assert_matches(path, batch, requests)


def test_stall_free_chunks_match_generate(make_model: MakeModel) -> None:
    """At most 5 prompt tokens beside a step's decode rows (prefill_beside_decode): long
    prompts then prefill a few tokens at a time under other rows' decoding, and every row is
    still what generate() gives."""
    path = make_model(**SHAPES["gqa2-tied"])
    batch = cases(path)
    requests, engine = run_engine(path, batch, max_batch_size=4, prefill_beside_decode=5)
    assert engine.worker.step_kinds["mixed"] > 0  # chunks rode on decode rows
    assert_matches(path, batch, requests)


@pytest.mark.parametrize("chunk", [64, 7])
def test_preemption_matches_generate(make_model: MakeModel, chunk: int) -> None:
    path = make_model(**SHAPES["mha-untied-2shards"])
    batch = cases(path)
    # 20 pages of 4 hold 80 tokens: any one request fits (the longest needs 66), all of them
    # together (about 300) do not, so running requests must be preempted and recomputed.
    requests, engine = run_engine(path, batch, num_pages=20, max_batched_tokens=chunk)
    assert engine.num_preemptions > 0
    assert_matches(path, batch, requests)


def test_stop_token_ids_cut_like_generate(tiny_model: Path) -> None:
    batch = []
    for case in cases(tiny_model):
        tokens = expected(tiny_model, case)[0]
        # Stop on the token generate() produced halfway (its first occurrence ends the output).
        stop = tokens[len(tokens) // 2]
        batch.append(Case(case.prompt, case.max_tokens, stop_token_ids=(stop,)))
    requests, _ = run_engine(tiny_model, batch)
    assert_matches(tiny_model, batch, requests)
    assert all(r.output.finish_reason == "stop" for r in requests)


def test_eos_list_in_generation_config(tiny_model: Path, tmp_path: Path) -> None:
    """Qwen checkpoints list several eos ids; generate() stops on any of them, so must we."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model, path)
    generated = Counter(t for c in cases(tiny_model) for t in expected(tiny_model, c)[0][1:])
    common = generated.most_common(1)[0][0]
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], common]
    gen_file.write_text(json.dumps(gen))

    batch = cases(path)
    requests, _ = run_engine(path, batch)
    assert_matches(path, batch, requests)
    assert sum(r.output.finish_reason == "stop" for r in requests) >= 2


def test_context_limit_finishes_with_length(tiny_model: Path) -> None:
    batch = [c for c in cases(tiny_model) if len(c.prompt) < 40]
    requests, _ = run_engine(tiny_model, batch, max_model_len=40)
    assert_matches(tiny_model, batch, requests, max_model_len=40)
    assert any(r.num_tokens == 40 and r.output.finish_reason == "length" for r in requests)
