"""Hybrid Gated DeltaNet targets through the engine, on the CPU in float32: greedy tokens equal
transformers' generate() on every row (chunked prefill, several rows a batch, preemption, n > 1);
a drafter on a hybrid target changes no output, greedy or seeded, at every verify width, and one
that drafts well is accepted; a shared prefix and an n-sample prompt are computed once, their
state restored from snapshots; memory sizing counts what the state and snapshot slots allocate."""

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
from batchrun.engine.core.state_snapshots import STRIDE_PAGES
from batchrun.engine.linear_slots import linear_memory_bytes, snapshot_slots
from batchrun.engine.memory import job_kv_pages, page_bytes
from batchrun.models.families import paged_layers
from batchrun.models.qwen3_5 import Qwen3_5Shape, linear_scratch_bytes, linear_state_bytes
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.bigram_method import Bigram, learnt_table, write_draft
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end
from tests.helpers.hybrid_models import KINDS, VOCAB, make_hybrid, with_tokenizer
from tests.helpers.hybrid_runs import MAX_TOKENS, SMALL, prompts, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=KINDS)
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, hybrid_tokenizer: Path
) -> tuple[Path, nn.Module]:
    out = tmp_path_factory.mktemp(request.param)
    reference = make_hybrid(out, request.param)
    with_tokenizer(out, hybrid_tokenizer)
    return out, reference


def run(target: Path, draft: Path | None, params: Sequence[SamplingParams], **settings: Any):
    """Every prompt under each of `params`; the finished requests and the engine."""
    engine = cpu_engine(target, draft, **(SMALL | settings))
    jobs = [(p, sp) for p in prompts() for sp in params]
    return run_to_end(engine, requests_of(jobs)), engine


def generated(reference: nn.Module, prompt: list[int], eos: set[int]) -> list[int]:
    """transformers' greedy tokens for `prompt`, cut after the first end-of-sequence."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )[0, len(prompt) :].tolist()
    cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut]


@torch.no_grad()
def test_greedy_tokens_equal_generate(hybrid: tuple[Path, nn.Module]) -> None:
    path, reference = hybrid
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2)
    finished, engine = run(path, None, [greedy])
    assert engine.num_preemptions > 0, "the pool was meant to run dry"
    assert engine.info()["prefix_caching"] is True  # prefixes restore their state snapshots
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
    per_layer = [
        (s.conv, s.recurrent, s.scratch_qkv, s.kept.kv, s.kept.g, s.kept.beta) for s in states
    ]
    shared = next(iter(states)).kept  # every layer's counts and buffers are the same tensors
    assert all(s.kept.count is shared.count and s.kept.buffer is shared.buffer for s in states)
    allocated = sum(t.nbytes for ts in per_layer for t in ts)
    allocated += shared.count.nbytes + shared.buffer.nbytes
    assert allocated == linear_memory_bytes(shape, dtype, 3, 1)
    # The snapshot pool: the slots past the requests' and the scratch slot's, as many as the
    # page pool hands out, each one state.
    linear = runner.linear
    assert linear.num_snapshots == snapshot_slots(3) == engine.pool.snapshots.num_slots > 0
    first = 3 + 1
    pooled = sum(t[first:].nbytes for s in states for t in (s.conv, s.recurrent))
    assert pooled == snapshot_slots(3) * linear_state_bytes(shape, dtype)
    assert first + linear.num_snapshots == next(iter(states)).conv.shape[0]
    # The K/V pool holds the full-attention layers only, and the pages are what is left.
    assert len(runner.kv_caches) == paged_layers(shape) < shape.num_layers
    # A budget that binds: the pages are what the state slots leave of it.
    per_page = page_bytes(shape, None, engine.config.page_size, dtype.itemsize, 0)
    budget = allocated + 10 * per_page + per_page // 2
    monkeypatch.setattr(memory, "CPU_KV_BUDGET_BYTES", budget)
    assert job_kv_pages(engine.config, shape, None, dtype, torch.device("cpu")) == 10
    # Rollback at W = 16: per decode slot (a request's, the scratch slot's) W rows of per-token
    # inputs, and no copy of the state.
    states_of_one = 2 + snapshot_slots(1)  # its slot, the scratch slot, its snapshots
    scratch = linear_memory_bytes(shape, dtype, 1, 16) - states_of_one * linear_state_bytes(
        shape, dtype
    )
    pending = 2 * 2 * torch.int32.itemsize  # two decode slots' counts and buffers
    assert scratch == 2 * 16 * linear_scratch_bytes(shape, dtype) + pending
    with_draft = linear_memory_bytes(shape, dtype, 3, draft_block)
    assert with_draft - allocated == 4 * (draft_block - 1) * linear_scratch_bytes(shape, dtype)


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
        assert stats["prefix_caching"] is True
    assert completions["dflash"] == completions["plain"]


SHARED = 70  # a prefix many pages long: past the first stored boundary
STRIDE = STRIDE_PAGES * 4  # that boundary (cpu_engine's pages hold 4 tokens)


def shared_prefix_prompts(rows: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (SHARED,), generator=gen).tolist()
    return [
        prefix + torch.randint(0, VOCAB, (3 + 2 * i,), generator=gen).tolist() for i in range(rows)
    ]


@pytest.mark.parametrize("num_pages", [200, 40])
def test_a_shared_prefix_is_computed_once_and_restored(
    text_pair: tuple[Path, nn.Module], num_pages: int
) -> None:
    """Rows sharing a prefix: the first computes it and stores its state at the boundary, the
    rest start there (the hit rate counts them) and still generate what transformers does; with
    few pages, through preemptions too."""
    path, reference = text_pair
    assert SHARED > STRIDE
    rows = shared_prefix_prompts(5)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    engine = cpu_engine(path, None, **(SMALL | {"num_pages": num_pages}))
    finished = run_to_end(engine, requests_of([(p, greedy) for p in rows]))
    info = engine.info()
    assert info["prefix_caching"] is True
    assert info["prefix_cache_hit_rate"] > 0
    if num_pages == 200:  # every later row starts at the boundary
        assert engine.num_preemptions == 0
        assert info["prompt_tokens_computed"] == sum(map(len, rows)) - STRIDE * (len(rows) - 1)
    else:
        assert engine.num_preemptions > 0, "the pool was meant to run dry"
    eos = engine.stopper.eos_ids
    by_row = {r.row_index: r.output.token_ids for r in finished}
    for row, prompt in enumerate(rows):
        assert by_row[row] == generated(reference, prompt, eos), row


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_fork_from_the_prompts_state(
    text_pair: tuple[Path, nn.Module], prefix_caching: bool
) -> None:
    """n = 3 samples of a prompt: it is computed once (the siblings restore its state at its
    last page and compute the rest), and each sample is what transformers generates."""
    path, reference = text_pair
    prompt = prompts()[3]  # 30 tokens: the fork at 28
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=3)
    engine = cpu_engine(
        path, None, **(SMALL | {"num_pages": 200, "prefix_caching": prefix_caching})
    )
    finished = run_to_end(engine, requests_of([(prompt, greedy)]))
    fork = (len(prompt) - 1) // 4 * 4
    assert engine.info()["prompt_tokens_computed"] == len(prompt) + 2 * (len(prompt) - fork)
    want = generated(reference, prompt, engine.stopper.eos_ids)
    assert [r.output.token_ids for r in finished] == [want] * 3
