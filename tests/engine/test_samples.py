"""n samples per prompt: seeds, the engine's shared prompt pages (against n separate rows with
the same seeds, with and without prefix caching and a draft, under preemption), the sampled
distribution against transformers' own logits, and jobs with n > 1 (error rows, parts that keep
a row's samples together, resume after a failure and after kill -9, the Ray path)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM

from batchrun.config.job import JobSpec
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request, row_seed, sample_requests, sample_seed
from batchrun.engine.engine import Engine
from batchrun.io.output.stats import RunClock
from batchrun.runners.local import run_job
from batchrun.runners.opened_job import open_job
from batchrun.runners.ray import BatchrunProcessor
from batchrun.runners.ray.committer import commit_outputs
from batchrun.runners.ray.processor import processor_settings
from batchrun.runners.ray.run import preflight_info
from batchrun.sampling.params import MAX_SAMPLES, SamplingParams
from tests.cluster.test_pipeline import FakeEngine
from tests.helpers.dflash_train import trained_draft_beside
from tests.helpers.engine_runs import run_to_end
from tests.job.test_cli import invoke, kill_three_times, write_job
from tests.sampling.test_sampler import Params, chi_square_p_value, reference

PAGE = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def engine_for(target: Path, draft: Path | None = None, **config: Any) -> Engine:
    settings = {"max_batch_size": 8, "max_batched_tokens": 64, "num_pages": 64} | config
    return Engine(
        EngineConfig(
            target=target,
            draft=draft,
            device="cpu",
            dtype="float32",
            attention_backend="torch",
            page_size=PAGE,
            verify_width="full",
            **settings,
        )
    )


def run_all(engine: Engine, requests: list[Request]) -> tuple[list[Request], int]:
    """Every sample finished, by (row_index, sample_index), and the prompt tokens prefilled."""
    finished = run_to_end(engine, requests)
    return finished, engine.info()["prompt_tokens_computed"]


def assert_pool_idle(engine: Engine) -> None:
    pool = engine.pool
    assert pool.num_held == 0 and pool.num_free == pool.num_pages


# -- seeds ----------------------------------------------------------------------------------


def test_sample_zero_keeps_the_row_seed_and_every_sample_has_its_own() -> None:
    assert row_seed(7, 5) == row_seed(7, 5, 0) == (7 * 0x9E3779B1 + 5) & (2**63 - 1)
    assert sample_seed(123, 0) == 123
    seeds = [row_seed(0, row, i) for row in range(2000) for i in range(8)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**64 for s in seeds)
    assert row_seed(3, 9, 2) == sample_seed(row_seed(3, 9), 2)  # a row's own seed is the base
    request = Request(4, [1, 2, 3], SamplingParams(seed=99, n=3, temperature=0.5))
    group = sample_requests(request)
    assert group[0] is request and [r.sample_index for r in group] == [0, 1, 2]
    assert [r.params.seed for r in group] == [99, sample_seed(99, 1), sample_seed(99, 2)]
    assert all(r.siblings is group and r.row_index == 4 for r in group)
    assert sample_requests(Request(0, [1], SamplingParams()))[0].siblings == []
    assert SamplingParams(n=0).problem() == f"n must be an integer in [1, {MAX_SAMPLES}], got 0"
    assert SamplingParams(n=MAX_SAMPLES).problem() is None


# -- the engine -----------------------------------------------------------------------------


def prompts_of(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]


LENGTHS = (21, 13, 30, 3, 17)  # 3: no full page to share; 17: a full last page


@pytest.mark.parametrize(
    "draft_kind", [None, "", "sliding"], ids=["target-only", "dflash", "sliding-dflash"]
)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("num_pages", [64, 14], ids=["roomy", "preempting"])
def test_n_samples_equal_n_separate_rows_and_prefill_the_prompt_once(
    make_model: Any, draft_kind: str | None, prefix_caching: bool, num_pages: int
) -> None:
    """A sliding draft's siblings leave its window (W - 1 = 5 tokens) to compute."""
    target = make_model(num_layers=4, vocab_size=1088, tie_word_embeddings=False)
    draft = trained_draft_beside(target, draft_kind) if draft_kind is not None else None
    n = 4
    prompts = prompts_of(LENGTHS, seed=5)
    params = [
        SamplingParams(max_tokens=8 + i, temperature=0.0 if i == 1 else 0.9, seed=i, n=n)
        for i in range(len(prompts))
    ]
    config = {"prefix_caching": prefix_caching, "num_pages": num_pages}
    grouped_engine = engine_for(target, draft, **config)
    grouped, prefilled = run_all(
        grouped_engine, [Request(i, p, params[i]) for i, p in enumerate(prompts)]
    )
    separate_engine = engine_for(target, draft, **config)
    separate, separate_prefilled = run_all(
        separate_engine,
        [
            Request(i, p, dataclasses.replace(params[i], n=1, seed=sample_seed(i, k)), k)
            for i, p in enumerate(prompts)
            for k in range(n)
        ],
    )
    assert [(r.row_index, r.sample_index) for r in grouped] == [
        (i, k) for i in range(len(prompts)) for k in range(n)
    ]
    assert [r.output.token_ids for r in grouped] == [r.output.token_ids for r in separate]
    assert [r.output.spec_hist for r in grouped] == [r.output.spec_hist for r in separate]
    sampled = [r.output.token_ids for r in grouped if r.row_index != 1]
    assert len({tuple(ids) for ids in sampled}) == len(sampled)  # each sample its own stream
    for engine in (grouped_engine, separate_engine):
        assert_pool_idle(engine)
    if num_pages == 64:  # each prompt once, then each sibling only what follows its full pages
        once = sum(len(p) for p in prompts)
        tail = grouped_engine.scheduler.recompute_tail
        assert tail == (5 if draft_kind == "sliding" else 1)
        tails = sum(len(p) - max(len(p) - tail, 0) // PAGE * PAGE for p in prompts)
        assert prefilled == once + (n - 1) * tails
        if not prefix_caching:
            assert separate_prefilled == n * once
    else:  # preempted samples come back and share again, or prefill alone: outputs hold
        assert grouped_engine.num_preemptions > 0


def test_greedy_samples_are_identical(make_model: Any) -> None:
    target = make_model(num_layers=4, vocab_size=1088, tie_word_embeddings=False)
    prompts = prompts_of((19, 9), seed=1)
    greedy = SamplingParams(max_tokens=12)
    one, _ = run_all(engine_for(target), [Request(i, p, greedy) for i, p in enumerate(prompts)])
    four, _ = run_all(
        engine_for(target),
        [Request(i, p, dataclasses.replace(greedy, n=4)) for i, p in enumerate(prompts)],
    )
    assert [r.output.token_ids for r in four] == [r.output.token_ids for r in one for _ in range(4)]


def test_first_tokens_of_n_samples_follow_the_targets_distribution(make_model: Any) -> None:
    """Many rows of one prompt, 8 samples each, one token: the first tokens, pooled and per
    sample_index, pass a chi-square test against transformers' own softmax of the prompt's
    last logits, and fail one against a temperature 20% off."""
    target = make_model(num_layers=4, vocab_size=1088, tie_word_embeddings=False)
    prompt = prompts_of((11,), seed=2)[0]
    model = Qwen3ForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    top = logits.topk(8).values
    temperature = float(top[0] - top[-1]) / 3  # the top 8 within a factor e^3 of each other
    rows, n = 300, 8
    params = SamplingParams(max_tokens=1, temperature=temperature, n=n)
    requests = [
        Request(r, prompt, dataclasses.replace(params, seed=row_seed(0, r))) for r in range(rows)
    ]
    finished, _ = run_all(engine_for(target, max_batch_size=64, num_pages=512), requests)
    first = torch.tensor([r.output.token_ids[0] for r in finished])
    probs = reference(logits, Params(temperature=temperature))
    assert chi_square_p_value(first, probs) > 1e-4
    by_sample = first.view(rows, n)
    for i in range(n):
        assert chi_square_p_value(by_sample[:, i], probs) > 1e-4
    wrong = reference(logits, Params(temperature=temperature * 1.2))
    assert chi_square_p_value(first, wrong) < 1e-4
    # The samples of a row are not copies of one draw.
    assert sum(len(set(row)) > 1 for row in by_sample.tolist()) > rows * 0.9


# -- jobs -----------------------------------------------------------------------------------


def write_rows(directory: Path, prompts: list[str | None], n: list[int | None]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "prompt": pa.array(prompts, pa.string()),
            "n": pa.array(n, pa.int64()),
            "number": list(range(len(prompts))),
        }
    )
    pq.write_table(table, directory / "in.parquet", row_group_size=4)


def read_parts(out: Path) -> list[pa.Table]:
    return [pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))]


def read_output(out: Path) -> pa.Table:
    order = [("row_index", "ascending"), ("sample_index", "ascending")]
    return pa.concat_tables(read_parts(out)).sort_by(order)


def samples_of(table: pa.Table) -> list[tuple[int, int]]:
    """(row_index, sample_index) of each row."""
    columns = (table.column(c).to_pylist() for c in ("row_index", "sample_index"))
    return list(zip(*columns, strict=True))


PROMPTS: list[str | None] = [f"def sample_{i}(x):" for i in range(10)] + ["", None]
N_CELLS: list[int | None] = [3, None, 1, 0, 2, MAX_SAMPLES + 1, 4, None, 2, 3, 2, None]
# Output rows per input row: its n (the job's 2 when null), 1 when the n is invalid (rows 3, 5).
EXPECTED_ROWS = [3, 2, 1, 1, 2, 1, 4, 2, 2, 3, 2, 2]


def assert_samples_per_row(out: Path) -> pa.Table:
    """Each input row's output rows: sample_index 0 .. n-1, all in one part."""
    for part in read_parts(out):
        counts = Counter(part.column("row_index").to_pylist())
        assert all(counts[row] == EXPECTED_ROWS[row] for row in counts), part
    table = read_output(out)
    assert samples_of(table) == [(row, i) for row, n in enumerate(EXPECTED_ROWS) for i in range(n)]
    return table


def test_a_job_with_n_gives_each_row_its_samples(tmp_path: Path, tiny_model: Path) -> None:
    write_rows(tmp_path / "in", PROMPTS, N_CELLS)
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tiny_model),
            n=2,
            temperature=0.8,
            max_tokens=6,
            rows_per_part=3,
            max_batch_size=4,
            quiet=True,
        )
    )
    stats = run_job(job)
    out = assert_samples_per_row(tmp_path / "out")
    rows = out.to_pylist()
    errors = {r["row_index"]: r["error"] for r in rows if r["error"] is not None}
    assert errors[3] == f"n must be an integer in [1, {MAX_SAMPLES}], got 0"
    assert errors[5].startswith("n must be an integer") and errors[10] == "prompt is empty"
    assert [r["row_index"] for r in rows if r["error"]] == [3, 5, 10, 10, 11, 11]
    for row in (0, 6, 9):  # sampled: the samples of a row differ
        completions = [tuple(r["completion_token_ids"]) for r in rows if r["row_index"] == row]
        assert len(set(completions)) == len(completions)
    assert stats["rows"] == sum(EXPECTED_ROWS) and stats["error_rows"] == 6
    assert stats["input_rows"] == len(PROMPTS)
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    summary = invoke("stats", str(tmp_path / "out"))
    assert f"rows: {sum(EXPECTED_ROWS)} ({sum(EXPECTED_ROWS) - 6} ok, 6 errors)" in summary.output
    # Sample 0 of each row is what n = 1 gives that row.
    single = job.with_keys(n=1, output=str(tmp_path / "single"))
    write_rows(tmp_path / "in1", PROMPTS, [None] * len(PROMPTS))
    run_job(single.with_keys(input=str(tmp_path / "in1")))
    firsts = [r for r in rows if r["sample_index"] == 0 and r["error"] is None]
    alone = {r["row_index"]: r for r in read_output(tmp_path / "single").to_pylist()}
    for row in firsts:
        assert row["completion_token_ids"] == alone[row["row_index"]]["completion_token_ids"]


def test_resume_after_a_failure_writes_each_sample_once(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_rows(tmp_path / "in", PROMPTS, N_CELLS)
    (tmp_path / "model").mkdir()
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tmp_path / "model"),
            n=2,
            rows_per_part=2,
            max_batch_size=2,
            quiet=True,
            max_tokens=3,
        )
    )
    reference = job.with_keys(output=str(tmp_path / "reference"))
    run_job(reference, FakeEngine(tokenizer))
    with pytest.raises(RuntimeError, match="fake engine failure"):
        run_job(job, FakeEngine(tokenizer, fail_at_step=9))
    partial = read_output(tmp_path / "out").column("row_index").to_pylist()
    assert 0 < len(set(partial)) < len(PROMPTS)
    assert_samples_per_row_so_far(tmp_path / "out")
    resumed = FakeEngine(tokenizer)
    stats = run_job(job, resumed)
    assert resumed.added < len(PROMPTS) - 4  # committed rows were skipped
    assert read_output(tmp_path / "out").equals(read_output(tmp_path / "reference"))
    assert_samples_per_row(tmp_path / "out")
    assert stats["rows"] == sum(EXPECTED_ROWS)


def assert_samples_per_row_so_far(out: Path) -> None:
    """A partial output: every row it holds has all its samples, once."""
    table = read_output(out)
    counts = Counter(table.column("row_index").to_pylist())
    assert all(counts[row] == EXPECTED_ROWS[row] for row in counts)
    pairs = samples_of(table)
    assert len(pairs) == len(set(pairs))


@pytest.mark.slow
def test_kill_9_and_rerun_with_n_gives_every_sample_once(tmp_path: Path, tiny_model: Path) -> None:
    rows = 12
    prompts: list[str | None] = [f"class Sampler{i}:\n    def draw(self, x):" for i in range(rows)]
    write_rows(tmp_path / "in", prompts, [None] * rows)
    extra = "temperature = 0.9\nn = 3\n"
    job = write_job(tmp_path, tiny_model, extra, rows_per_part=3, max_batch_size=2, max_tokens=8)
    assert invoke("run", str(job), "--output", str(tmp_path / "reference")).exit_code == 0
    out = tmp_path / "out"
    assert kill_three_times(job, out)[0], "the first run finished before it could be killed"
    committed = read_output(out)
    pairs = samples_of(committed)
    assert len(pairs) == len(set(pairs)) and len(pairs) % 3 == 0 and len(pairs) < 3 * rows
    assert invoke("run", str(job)).exit_code == 0
    resumed, expected = read_output(out), read_output(tmp_path / "reference")
    assert resumed.column("sample_index").to_pylist() == [0, 1, 2] * rows
    for column in ("row_index", "completion_token_ids", "finish_reason"):
        assert resumed.column(column).equals(expected.column(column)), column
    assert (out / "_SUCCESS").exists()


# -- the Ray path, without Ray --------------------------------------------------------------


def ray_job(tmp_path: Path, model: Path) -> JobSpec:
    return JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(model),
            n=2,
            temperature=0.8,
            max_tokens=5,
            max_batch_size=3,
            rows_per_part=4,
            quiet=True,
        )
    )


def test_processor_and_driver_give_a_local_runs_samples(tmp_path: Path, tiny_model: Path) -> None:
    """The processor returns each row's samples in order; the driver commits a row only once
    all its samples have come, whichever output blocks they come in and however often."""
    write_rows(tmp_path / "in", PROMPTS, N_CELLS)
    job = ray_job(tmp_path, tiny_model)
    local = job.with_keys(output=str(tmp_path / "local"))
    run_job(local)
    processor = BatchrunProcessor(**processor_settings(job))
    table = pq.read_table(tmp_path / "in" / "in.parquet")
    table = table.append_column("row_index", pa.array(range(len(PROMPTS)), pa.int64()))
    batches = [processor(table.slice(start, 5)) for start in range(0, len(PROMPTS), 5)]
    assert [b.num_rows for b in batches] == [
        sum(EXPECTED_ROWS[s : s + 5]) for s in range(0, len(PROMPTS), 5)
    ]

    def outputs(done: np.ndarray) -> Iterable[pa.Table]:
        first = batches[0]
        # Ray splits a batch's output into blocks: a row's samples arrive in two of them, and
        # a retried batch comes back again.
        return [first.slice(0, 2), batches[1], first.slice(2), first.slice(1, 3), *batches[1:]]

    opened = open_job(job)
    stats = commit_outputs(opened, preflight_info(job, opened.prompt), RunClock(), outputs)
    got = assert_samples_per_row(tmp_path / "out")
    assert got.to_pylist() == read_output(tmp_path / "local").to_pylist()
    assert stats["rows"] == sum(EXPECTED_ROWS)
    assert stats["ray"]["duplicate_rows_dropped"] == 3 + batches[1].num_rows
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["rows"] == stats["rows"]
