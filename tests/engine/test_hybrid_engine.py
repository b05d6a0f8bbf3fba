"""Hybrid Gated DeltaNet targets through the engine, on the CPU in float32: greedy tokens equal
transformers' generate() on every row (chunked prefill, several rows a batch, preemption, n > 1);
a drafter on a hybrid target changes no output, greedy or seeded, at every verify width, and one
that drafts well is accepted; memory sizing counts what the state slots allocate."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from batchrun.cli import cli
from batchrun.engine import memory
from batchrun.engine.core.requests import Request
from batchrun.engine.linear_slots import linear_memory_bytes
from batchrun.engine.memory import job_kv_pages, page_bytes
from batchrun.models.families import paged_layers
from batchrun.models.qwen3_5 import Qwen3_5Shape, linear_scratch_bytes, linear_state_bytes
from batchrun.sampling.params import SamplingParams
from batchrun.tools.bpe import build_tokenizer
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end
from tests.helpers.hybrid_models import KINDS, VOCAB, make_hybrid
from tests.spec_decode.test_method_registry import Bigram, bigram, learnt_table, write_draft

__all__ = ["bigram"]  # the fixture, registered for the tests that take it
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENGTHS = (1, 5, 13, 30, 47, 9)  # most longer than a prefill chunk (16 rows)
MAX_TOKENS = 12
# Few pages: four running requests outgrow them, so some are preempted and recomputed.
SMALL = {"max_batched_tokens": 16, "max_batch_size": 4, "num_pages": 24, "cuda_graphs": False}


@pytest.fixture(scope="module")
def hybrid_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE tokenizer over the tiny hybrids' vocabulary (VOCAB ids)."""
    out = tmp_path_factory.mktemp("hybrid-tokenizer")
    build_tokenizer(out, vocab_size=VOCAB, max_bytes=200_000)
    return out


def with_tokenizer(out: Path, tokenizer: Path) -> None:
    for file in tokenizer.iterdir():
        (out / file.name).write_bytes(file.read_bytes())


@pytest.fixture(scope="module", params=KINDS)
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, hybrid_tokenizer: Path
) -> tuple[Path, nn.Module]:
    out = tmp_path_factory.mktemp(request.param)
    reference = make_hybrid(out, request.param)
    with_tokenizer(out, hybrid_tokenizer)
    return out, reference


@pytest.fixture(scope="module")
def text_hybrid(tmp_path_factory: pytest.TempPathFactory, hybrid_tokenizer: Path) -> Path:
    """The Qwen3.5 text checkpoint the drafter tests run on."""
    out = tmp_path_factory.mktemp("qwen3_5_text")
    make_hybrid(out, "qwen3_5_text")
    with_tokenizer(out, hybrid_tokenizer)
    return out


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def run(target: Path, draft: Path | None, params: Sequence[SamplingParams], **settings: Any):
    """Every prompt under each of `params`; the finished requests and the engine."""
    engine = cpu_engine(target, draft, **(SMALL | settings))
    jobs = [(p, sp) for p in prompts() for sp in params]
    return run_to_end(engine, requests_of(jobs)), engine


def tokens(requests: list[Request]) -> list[list[int]]:
    return [r.output.token_ids for r in requests]


@torch.no_grad()
def test_greedy_tokens_equal_generate(hybrid: tuple[Path, nn.Module]) -> None:
    path, reference = hybrid
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2)
    finished, engine = run(path, None, [greedy])
    assert engine.num_preemptions > 0, "the pool was meant to run dry"
    assert engine.info()["prefix_caching"] is False  # a cached prefix would skip the state
    by_row = {r.row_index: [] for r in finished}
    for r in finished:
        by_row[r.row_index].append(r.output.token_ids)
    eos = engine.stopper.eos_ids
    for row, prompt in enumerate(prompts()):
        ids = torch.tensor([prompt])
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )[0, len(prompt) :].tolist()
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        assert by_row[row] == [out[:cut]] * 2, row  # each of the n samples


@pytest.mark.parametrize("verify_width", [2, 4, "full", "auto"])
def test_a_dflash_draft_on_a_hybrid_target_changes_no_output(
    text_hybrid: Path, tmp_path: Path, verify_width: int | str
) -> None:
    draft = make_tiny_draft(tmp_path / "draft", text_hybrid, block_size=4)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7),
    ]
    alone, _ = run(text_hybrid, None, params)
    drafted, engine = run(text_hybrid, draft, params, verify_width=verify_width)
    assert tokens(drafted) == tokens(alone)
    assert sum(r.output.spec_rounds for r in drafted) > 0
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("verify_width", [2, 4, "full"])
def test_an_accepting_drafter_on_a_hybrid_target_is_accepted_and_lossless(
    bigram: Bigram, text_hybrid: Path, tmp_path: Path, verify_width: int | str
) -> None:
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7),
    ]
    alone, _ = run(text_hybrid, None, params)
    draft = write_draft(tmp_path / "bigram", learnt_table(alone, VOCAB))
    drafted, engine = run(text_hybrid, draft, params, verify_width=verify_width)
    assert tokens(drafted) == tokens(alone)
    per_forward = engine.info()["tokens_per_target_forward"]
    assert per_forward is not None and per_forward > 1.0, "drafts were accepted"


def test_memory_sizing_counts_what_the_state_slots_allocate(
    text_hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = {"max_batch_size": 3, "max_batched_tokens": 16, "cuda_graphs": False}
    draft_block = 4  # as make_tiny_draft's: the widest verify step
    engine = cpu_engine(text_hybrid, None, **settings)
    runner, shape = engine.runner, engine.model.shape
    assert isinstance(shape, Qwen3_5Shape) and runner.linear is not None
    dtype = engine.model.lm_head.weight.dtype
    states = runner.linear.states.values()
    slot = sum(t[0].nbytes for s in states for t in (s.conv, s.recurrent))
    assert slot == linear_state_bytes(shape, dtype)  # one slot, every linear layer
    allocated = sum(
        t.nbytes
        for s in states
        for t in (s.conv, s.recurrent, s.scratch_qkv, s.scratch_g, s.scratch_beta)
    )
    assert allocated == linear_memory_bytes(shape, dtype, 3, 1)
    # The K/V pool holds the full-attention layers only, and the pages are what is left.
    assert len(runner.kv_caches) == paged_layers(shape) < shape.num_layers
    # A budget that binds: the pages are what the state slots leave of it.
    per_page = page_bytes(shape, None, engine.config.page_size, dtype.itemsize, 0)
    budget = allocated + 10 * per_page + per_page // 2
    monkeypatch.setattr(memory, "CPU_KV_BUDGET_BYTES", budget)
    assert job_kv_pages(engine.config, shape, None, dtype, torch.device("cpu")) == 10
    # Rollback at W = 16: per request, the scratch holds W rows of per-token inputs and no copy
    # of the state (at most 1.25x one state plus O(W) rows).
    scratch = linear_memory_bytes(shape, dtype, 1, 16) - 2 * linear_state_bytes(shape, dtype)
    assert scratch == 16 * linear_scratch_bytes(shape, dtype)
    assert scratch <= 1.25 * linear_state_bytes(shape, dtype) + 16 * linear_scratch_bytes(
        shape, dtype
    )
    with_draft = linear_memory_bytes(shape, dtype, 3, draft_block)
    assert with_draft - allocated == 3 * (draft_block - 1) * linear_scratch_bytes(shape, dtype)


def test_validate_and_a_whole_job_on_a_hybrid_checkpoint(text_hybrid: Path, tmp_path: Path) -> None:
    """`batchrun validate`, then `batchrun run` with and without a draft: every row written,
    the same completions."""
    rows = pa.table({"prompt": [f"def step_{i}(state):" for i in range(6)]})
    (tmp_path / "in").mkdir()
    pq.write_table(rows, tmp_path / "in" / "0.parquet")
    draft = make_tiny_draft(tmp_path / "draft", text_hybrid, block_size=4)
    common = ["--input", str(tmp_path / "in"), "--target", str(text_hybrid), "--max-tokens", "8"]
    validate = ["validate", *common, "--output", str(tmp_path / "v"), "--draft", str(draft)]
    checked = CliRunner().invoke(cli, validate)
    assert checked.exit_code == 0, checked.output
    completions = {}
    for name, extra in {"plain": [], "dflash": ["--draft", str(draft)]}.items():
        out = tmp_path / name
        result = CliRunner().invoke(cli, ["run", *common, "--output", str(out), "--quiet", *extra])
        assert result.exit_code == 0, result.output
        table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
        assert sorted(table.column("row_index").to_pylist()) == list(range(6))
        completions[name] = table.sort_by("row_index").column("completion").to_pylist()
        stats = json.loads((out / "stats.json").read_text())
        assert stats["prefix_caching"] is False
    assert completions["dflash"] == completions["plain"]
