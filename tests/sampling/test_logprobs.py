"""Log-probabilities against transformers, float32 on the CPU.

Completion logprobs of greedy rows are generate()'s own logits, log-softmaxed; those of sampled
rows are transformers' logits warped by its own temperature/top-k/top-p processors (the
processed distribution the engine samples from), both to 1e-4. The draft changes no value,
nor do CUDA-graph padding, chunked prefill, preemption or stop rules cutting a round; prompt
logprobs are a transformers forward over the prompt. Then the columns, end to end: a job's
Parquet parts read by polars, error rows null, and jobs without logprobs keep their schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from transformers import (
    AutoTokenizer,
    Qwen3ForCausalLM,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.errors import JobError
from batchrun.io.output.columns import OUTPUT_FIELDS, output_schema
from batchrun.runners.local import run_job
from batchrun.runners.ray import BatchrunProcessor
from batchrun.sampling import logprobs as logprobs_module
from batchrun.sampling.logprobs import token_logprobs
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.sampler import SamplingBatch, sample
from tests.helpers.dflash_train import TARGET_SHAPE, trained_draft_beside, training_prompts
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end

MakeModel = Callable[..., Path]
Job = tuple[list[int], SamplingParams]

pytestmark = pytest.mark.usefixtures("one_thread_module")  # module fixtures (drafts) too
TOLERANCE = 1e-4
K = 5


@pytest.fixture(scope="module")
def draft(target: Path) -> Path:
    return trained_draft_beside(target)


@cache
def hf_model(model_dir: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def prompts(count: int = 12, seed: int = 5) -> list[list[int]]:
    """The draft's training prompts (long accepted runs) and random ones (short runs)."""
    gen = torch.Generator().manual_seed(seed)
    out = training_prompts(seed=0)
    while len(out) < count:
        length = int(torch.randint(1, 40, (1,), generator=gen))
        out.append(torch.randint(3, 1000, (length,), generator=gen).tolist())
    return out[:count]


def run(
    target: Path,
    draft: Path | None,
    jobs: list[Job],
    emulate_graphs: bool = False,
    **config: Any,
) -> tuple[Engine, list[Request]]:
    """Every job through one engine; finished requests in row order."""
    settings: dict[str, Any] = {
        "max_batch_size": 8,
        "max_batched_tokens": 64,
        "num_pages": 96,
        "page_size": 4,
        "verify_width": "full",
        "logprobs": K,
    }
    engine = cpu_engine(target, draft, cuda_graphs=False, **(settings | config))
    if emulate_graphs:
        engine.capture_graphs()
    finished = run_to_end(engine, requests_of(jobs))
    assert len(finished) == sum(params.n for _, params in jobs)
    return engine, finished


def scored(req: Request) -> tuple[list[float], list[list[tuple[int, float]]]]:
    lp = req.output.logprobs
    assert lp is not None and lp.tokens is not None and lp.top is not None
    assert len(lp.tokens) == len(lp.top) == len(req.output.token_ids)
    return lp.tokens, lp.top


def hf_processed(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of logits [N, V] warped as transformers' sampling warps them."""
    scores = logits.clone()
    if params.temperature > 0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.top_k:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.log_softmax(dim=-1)


def hf_forward_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0]


def check_against(expected: torch.Tensor, req: Request, row: int) -> None:
    """The request's logprobs against expected log-probabilities [len(output), V]: the chosen
    token's, and the top K (sorted; their values; the ids where no near-tie makes them
    ambiguous; only tokens the distribution keeps)."""
    chosen, top = scored(req)
    for i, token in enumerate(req.output.token_ids):
        where = f"row {row} token {i}"
        assert chosen[i] == pytest.approx(float(expected[i, token]), abs=TOLERANCE), where
        finite = int(torch.isfinite(expected[i]).sum())
        values, ids = expected[i].topk(min(K, finite))
        assert [v for _, v in top[i]] == sorted((v for _, v in top[i]), reverse=True), where
        assert [v for _, v in top[i]] == pytest.approx(values.tolist(), abs=TOLERANCE), where
        for j, (token_id, _) in enumerate(top[i]):
            gaps = [abs(float(values[j] - values[m])) for m in range(len(values)) if m != j]
            if min(gaps, default=1.0) > 10 * TOLERANCE:
                assert token_id == int(ids[j]), where
        if chosen[i] >= top[i][-1][1] + TOLERANCE:
            assert token in [t for t, _ in top[i]], where


# -- the values -----------------------------------------------------------------------------


def test_greedy_logprobs_are_generates_logits(target: Path) -> None:
    jobs = [(p, SamplingParams(max_tokens=16)) for p in prompts()]
    _, finished = run(target, None, jobs, max_batched_tokens=24)  # chunked prefill too
    model = hf_model(target)
    for row, ((prompt, _), req) in enumerate(zip(jobs, finished, strict=True)):
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=16,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert (
            req.output.token_ids
            == out.sequences[0, len(prompt) :].tolist()[: len(req.output.token_ids)]
        )
        expected = torch.cat(out.logits)[: len(req.output.token_ids)].log_softmax(dim=-1)
        check_against(expected, req, row)


SAMPLED = [
    SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=1),
    SamplingParams(max_tokens=12, temperature=1.3, seed=2),
    SamplingParams(max_tokens=12, temperature=0.7, top_p=0.6, seed=3),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=3, seed=4),  # fewer kept than K
    SamplingParams(max_tokens=12),  # greedy among sampled rows
]


def sampled_jobs() -> list[Job]:
    return [(p, SAMPLED[i % len(SAMPLED)]) for i, p in enumerate(prompts())]


def test_sampled_logprobs_are_transformers_processed_distribution(target: Path) -> None:
    jobs = sampled_jobs()
    _, finished = run(target, None, jobs)
    for row, ((prompt, params), req) in enumerate(zip(jobs, finished, strict=True)):
        logits = hf_forward_logits(target, prompt + req.output.token_ids[:-1])[len(prompt) - 1 :]
        check_against(hf_processed(params, logits), req, row)
        _, top = scored(req)
        if params.top_k == 3:  # only the kept tokens are listed
            assert {len(t) for t in top} == {3}


def test_token_logprobs_use_the_samplers_own_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token the sampler draws has a finite logprob; the filtered rows' distributions are
    transformers' warped ones; chunks of a few rows give the same values as one chunk."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=gen) * 3
    params = [SAMPLED[i % len(SAMPLED)] for i in range(12)]
    batch = SamplingBatch(
        temperature=torch.tensor([p.temperature for p in params]),
        top_p=torch.tensor([p.top_p for p in params]),
        top_k=torch.tensor([p.top_k for p in params]),
        seed=torch.arange(12),
        step=torch.full((12,), 7),
    )
    tokens = sample(logits, batch)
    chosen, values, ids = token_logprobs(logits, batch, tokens, K, any_filtered=True)
    assert torch.isfinite(chosen).all()
    for i, p in enumerate(params):
        expected = hf_processed(p, logits[i : i + 1])[0]
        assert chosen[i] == pytest.approx(float(expected[tokens[i]]), abs=1e-6)
        assert torch.equal(values[i].isfinite(), expected[ids[i]].isfinite())
    monkeypatch.setattr(logprobs_module, "rows_per_chunk", lambda rows, vocab: 5)
    again = token_logprobs(logits, batch, tokens, K, any_filtered=True)
    for a, b in zip((chosen, values, ids), again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("width", ["full", "auto"])
def test_the_draft_changes_no_value(target: Path, draft: Path, width: str) -> None:
    jobs = sampled_jobs()
    _, plain = run(target, None, jobs)
    engine, spec = run(target, draft, jobs, verify_width=width)
    assert any(k > 1 and n for r in spec for k, n in enumerate(r.output.spec_hist or [], 1))
    for row, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert a.output.token_ids == b.output.token_ids, f"row {row}"
        (chosen_a, top_a), (chosen_b, top_b) = scored(a), scored(b)
        assert chosen_b == pytest.approx(chosen_a, abs=TOLERANCE), f"row {row}"
        for i, (x, y) in enumerate(zip(top_a, top_b, strict=True)):
            assert [v for _, v in y] == pytest.approx([v for _, v in x], abs=TOLERANCE), (row, i)


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "dflash"])
def test_graph_padding_is_ignored(target: Path, draft: Path, with_draft: bool) -> None:
    """Emulated CUDA graphs (a CPU) run the steady-state steps padded to their ladder size; the
    padded rows' logits are left out."""
    jobs = sampled_jobs()[:7]
    d = draft if with_draft else None
    _, eager = run(target, d, jobs)
    engine, graphed = run(target, d, jobs, emulate_graphs=True)
    assert any(size > 1 for _, size in engine.runner.replays)
    for a, b in zip(eager, graphed, strict=True):
        assert a.output.token_ids == b.output.token_ids
        assert scored(b)[0] == pytest.approx(scored(a)[0], abs=TOLERANCE)


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "dflash"])
def test_stop_rules_keep_the_logprobs_aligned(target: Path, draft: Path, with_draft: bool) -> None:
    """A stop token (or the length) cutting a verify round keeps exactly the committed tokens'
    values: a prefix of the uncut run's."""
    d = draft if with_draft else None
    jobs = [(p, SamplingParams(max_tokens=30)) for p in prompts(8)]
    _, full = run(target, d, jobs)
    cut_jobs = []
    for (prompt, _), req in zip(jobs, full, strict=True):
        stop = req.output.token_ids[len(req.output.token_ids) // 2]
        cut_jobs.append((prompt, SamplingParams(max_tokens=25, stop_token_ids=(stop,))))
    _, cut = run(target, d, cut_jobs)
    for a, b in zip(full, cut, strict=True):
        n = len(b.output.token_ids)
        assert n < len(a.output.token_ids) and b.output.token_ids == a.output.token_ids[:n]
        chosen, top = scored(b)
        assert chosen == pytest.approx(scored(a)[0][:n], abs=TOLERANCE)
        assert len(top) == n


def check_prompt_logprobs(
    target: Path, jobs: list[Job], finished: list[Request], k: int = K
) -> None:
    """Each prompt token's value, and its k most probable tokens: torch.topk of transformers'
    log_softmax at the position before it (ids where no near-tie makes them ambiguous)."""
    for row, ((prompt, _), req) in enumerate(zip(jobs, finished, strict=True)):
        lp = req.output.logprobs
        assert lp is not None and lp.prompt is not None
        got = lp.prompt
        assert len(got) == len(prompt) and got[0] is None, f"row {row}"
        expected = hf_forward_logits(target, prompt).log_softmax(dim=-1)
        want = [float(expected[j - 1, prompt[j]]) for j in range(1, len(prompt))]
        assert got[1:] == pytest.approx(want, abs=TOLERANCE), f"row {row}"
        if not k:
            assert lp.prompt_top is None
            continue
        assert lp.prompt_top is not None and len(lp.prompt_top) == len(prompt), f"row {row}"
        assert lp.prompt_top[0] is None, f"row {row}"
        for j in range(1, len(prompt)):
            top, where = lp.prompt_top[j], f"row {row} prompt token {j}"
            assert top is not None and len(top) == k, where
            values, ids = expected[j - 1].topk(k)
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=TOLERANCE), where
            for i, (token_id, _) in enumerate(top):
                gaps = [abs(float(values[i] - values[m])) for m in range(k) if m != i]
                if min(gaps, default=1.0) > 10 * TOLERANCE:
                    assert token_id == int(ids[i]), where


def test_prompt_logprobs_are_a_transformers_forward(
    target: Path, draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill (chunks of 7 rows, some prompts of several chunks), prompt rows scored a
    few at a time, and a repeated prompt, which prefix caching would have served from cache."""
    jobs = [(p, SamplingParams(max_tokens=4)) for p in prompts()]
    jobs.append(jobs[9])
    three_rows = 3 * logprobs_module.PROMPT_BYTES_PER_LOGIT * TARGET_SHAPE["vocab_size"]
    monkeypatch.setattr(logprobs_module, "PROMPT_CHUNK_BYTES", three_rows)
    engine, finished = run(
        target, draft, jobs, max_batched_tokens=7, logprobs=None, prompt_logprobs=K
    )
    assert not engine.pool.prefix_caching and engine.config.prefix_caching
    check_prompt_logprobs(target, jobs, finished)
    assert all(r.output.logprobs is not None and r.output.logprobs.tokens is None for r in finished)


def test_prompt_top_logprobs_are_the_same_in_one_chunk(target: Path) -> None:
    """K = 0 scores each prompt token as it always did, K > 0 the same values and its top K;
    a prompt prefilled over several steps scores as one prefilled at once."""
    jobs = [(p, SamplingParams(max_tokens=2)) for p in prompts()]
    _, alone = run(target, None, jobs, max_batched_tokens=512, logprobs=None, prompt_logprobs=0)
    _, whole = run(target, None, jobs, max_batched_tokens=512, logprobs=None, prompt_logprobs=K)
    _, chunked = run(target, None, jobs, max_batched_tokens=7, logprobs=None, prompt_logprobs=K)
    for row, (a, b, c) in enumerate(zip(alone, whole, chunked, strict=True)):
        assert (
            a.output.logprobs is not None
            and b.output.logprobs is not None
            and c.output.logprobs is not None
        )
        assert a.output.logprobs.prompt_top is None
        assert a.output.logprobs.prompt == b.output.logprobs.prompt, f"row {row}"
        assert c.output.logprobs.prompt[1:] == pytest.approx(
            b.output.logprobs.prompt[1:], abs=TOLERANCE
        )
        assert b.output.logprobs.prompt_top is not None and c.output.logprobs.prompt_top is not None
        for x, y in zip(
            b.output.logprobs.prompt_top[1:], c.output.logprobs.prompt_top[1:], strict=True
        ):
            assert x is not None and y is not None
            assert [v for _, v in y] == pytest.approx([v for _, v in x], abs=TOLERANCE), row
    check_prompt_logprobs(target, jobs, chunked)


def test_every_sample_scores_its_prompt(target: Path) -> None:
    """A row's samples share its prompt's pages, except when prompt log-probabilities are
    asked for: then each computes (and scores) the whole prompt."""
    jobs = [(p, SamplingParams(max_tokens=4, n=3)) for p in prompts(4)]
    _, finished = run(target, None, jobs, logprobs=None, prompt_logprobs=K)
    check_prompt_logprobs(target, [job for job in jobs for _ in range(3)], finished)


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "dflash"])
def test_preemption_neither_loses_nor_repeats_logprobs(
    target: Path, draft: Path, with_draft: bool
) -> None:
    """A pool too small for the batch preempts requests, mid-prefill and mid-generation; their
    recomputed rows score nothing twice."""
    jobs = sampled_jobs()
    d = draft if with_draft else None
    config = {"prompt_logprobs": K, "max_batched_tokens": 24}
    engine, small = run(target, d, jobs, num_pages=20, **config)
    assert engine.num_preemptions > 0
    _, roomy = run(target, d, jobs, **config)
    check_prompt_logprobs(target, jobs, small)
    for a, b in zip(roomy, small, strict=True):
        assert a.output.token_ids == b.output.token_ids
        assert scored(b)[0] == pytest.approx(scored(a)[0], abs=TOLERANCE)


# -- the columns ----------------------------------------------------------------------------


def write_input(directory: Path) -> Path:
    directory.mkdir()
    table = pa.table(
        {
            "prompt": ["def f(x):", "", "import os\nimport sys", "class A:"],
            "temperature": [0.0, 0.0, 0.9, None],
            "top_k": [None, None, 4, None],
        }
    )
    pq.write_table(table, directory / "in.parquet")
    return directory


def make_job(tmp_path: Path, target: Path, **keys: Any) -> JobSpec:
    settings = {"max_tokens": 6, "max_batch_size": 3, "quiet": True, "device": "cpu"} | keys
    return JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"), output=str(tmp_path / "out"), target=str(target), **settings
        )
    )


def test_a_job_writes_the_columns_polars_reads(tmp_path: Path, target: Path) -> None:
    write_input(tmp_path / "in")
    job = make_job(tmp_path, target, logprobs=3, prompt_logprobs=2, dtype="float32")
    run_job(job)
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert pq.read_schema(parts[0]).equals(
        output_schema(pq.read_schema(tmp_path / "in" / "in.parquet"), 3, 2),
        check_metadata=False,
    )
    df = pl.read_parquet(parts).sort("row_index")
    assert df.schema["completion_logprobs"] == pl.List(pl.Float32)
    assert df.schema["completion_logprob_sum"] == pl.Float64
    top_type = pl.List(pl.List(pl.Struct({"token_id": pl.Int32, "logprob": pl.Float32})))
    assert df.schema["top_logprobs"] == df.schema["prompt_top_logprobs"] == top_type
    assert df.schema["prompt_logprobs"] == pl.List(pl.Float32)
    ok = df.filter(pl.col("error").is_null())
    assert ok.height == 3
    for row in ok.iter_rows(named=True):
        n = row["completion_tokens"]
        assert len(row["completion_logprobs"]) == len(row["top_logprobs"]) == n
        assert math.isclose(row["completion_logprob_sum"], sum(row["completion_logprobs"]))
        assert all(1 <= len(top) <= 3 for top in row["top_logprobs"])
        assert row["temperature"] != 0.9 or {len(top) for top in row["top_logprobs"]} == {3}
        assert len(row["prompt_logprobs"]) == row["prompt_tokens"]
        assert row["prompt_logprobs"][0] is None
        assert all(v is not None and v <= 0 for v in row["prompt_logprobs"][1:])
        assert len(row["prompt_top_logprobs"]) == row["prompt_tokens"]
        assert row["prompt_top_logprobs"][0] is None
        pairs = zip(row["prompt_logprobs"][1:], row["prompt_top_logprobs"][1:], strict=True)
        for value, top in pairs:  # the most probable is at least as probable as the token
            assert len(top) == 2 and value - 1e-6 <= top[0]["logprob"] >= top[1]["logprob"]
    # The greedy row's values are generate()'s.
    greedy = ok.filter(pl.col("row_index") == 0).row(0, named=True)
    prompt_ids = AutoTokenizer.from_pretrained(str(target)).encode("def f(x):")
    assert len(prompt_ids) == greedy["prompt_tokens"]
    completion = greedy["completion_token_ids"]
    logits = hf_forward_logits(target, prompt_ids + completion[:-1])[len(prompt_ids) - 1 :]
    want = logits.log_softmax(dim=-1).gather(1, torch.tensor(completion)[:, None])
    assert greedy["completion_logprobs"] == pytest.approx(want.squeeze(1).tolist(), abs=TOLERANCE)
    error = df.filter(pl.col("error").is_not_null()).row(0, named=True)
    for name in ("completion_logprobs", "completion_logprob_sum", "top_logprobs"):
        assert error[name] is None
    assert error["prompt_logprobs"] is None and error["prompt_top_logprobs"] is None


def test_without_logprobs_the_schema_is_unchanged(tmp_path: Path, target: Path) -> None:
    write_input(tmp_path / "in")
    run_job(make_job(tmp_path, target))
    schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
    added = schema.names[schema.get_field_index("row_index") :]
    assert added == [f.name for f in OUTPUT_FIELDS]
    # k = 0: the token's values without top_logprobs; prompt logprobs alone, with K = 0 as
    # they always were, with K > 0 their top K beside them.
    assert "top_logprobs" not in output_schema(pa.schema([]), 0).names
    assert output_schema(pa.schema([]), None, 0).names[-2:] == ["prompt_logprobs", "error"]
    assert output_schema(pa.schema([]), None, 1).names[-3:] == [
        "prompt_logprobs",
        "prompt_top_logprobs",
        "error",
    ]


def test_logprobs_are_part_of_the_job(tmp_path: Path, target: Path) -> None:
    """Another job's parts would have other columns: the output directory refuses it."""
    write_input(tmp_path / "in")
    run_job(make_job(tmp_path, target, max_tokens=2))
    with pytest.raises(JobError, match="logprobs"):
        run_job(make_job(tmp_path, target, max_tokens=2, logprobs=1))
    # prompt_logprobs = true is K = 0, the same job as before K existed; K > 0 is another.
    (tmp_path / "prompt").mkdir()
    write_input(tmp_path / "prompt" / "in")
    run_job(make_job(tmp_path / "prompt", target, max_tokens=2, prompt_logprobs=True))
    run_job(make_job(tmp_path / "prompt", target, max_tokens=2, prompt_logprobs=0))
    with pytest.raises(JobError, match="logprobs"):
        run_job(make_job(tmp_path / "prompt", target, max_tokens=2, prompt_logprobs=2))


def test_flags_and_bounds(tmp_path: Path, target: Path) -> None:
    write_input(tmp_path / "in")
    args = ["--input", str(tmp_path / "in"), "--target", str(target), "--device", "cpu"]
    result = CliRunner().invoke(
        cli,
        [
            "run",
            *args,
            "--output",
            str(tmp_path / "a"),
            "--max-tokens",
            "2",
            "--quiet",
            "--logprobs",
            "2",
            "--prompt-logprobs",
        ],
    )
    assert result.exit_code == 0, result.output
    schema = pq.read_schema(next((tmp_path / "a").glob("part-*.parquet")))
    assert {"completion_logprobs", "top_logprobs", "prompt_logprobs"} <= set(schema.names)
    assert "prompt_top_logprobs" not in schema.names  # a bare --prompt-logprobs is K = 0
    # --prompt-logprobs K, and --no-prompt-logprobs over a job file's K.
    job_file = tmp_path / "job.toml"
    job_file.write_text("prompt_logprobs = 2\nmax_tokens = 2\nquiet = true\n")
    for flags, out, columns in [
        (["--prompt-logprobs", "3"], "c", {"prompt_logprobs", "prompt_top_logprobs"}),
        ([], "d", {"prompt_logprobs", "prompt_top_logprobs"}),
        (["--no-prompt-logprobs"], "e", set()),
    ]:
        result = CliRunner().invoke(
            cli, ["run", str(job_file), *args, "--output", str(tmp_path / out), *flags]
        )
        assert result.exit_code == 0, result.output
        schema = pq.read_schema(next((tmp_path / out).glob("part-*.parquet")))
        assert {n for n in schema.names if "_logprobs" in n} == columns, flags
    for flags, message in [
        (["--logprobs", "21"], "job key 'logprobs'"),
        (["--logprobs", "-1"], "job key 'logprobs'"),
        (["--prompt-logprobs", "21"], "job key 'prompt_logprobs': 21 is greater than"),
        # K is optional: click takes a value that looks like an option for one.
        (["--prompt-logprobs", "-1"], "No such option '-1'"),
        (["--prompt-logprobs", "many"], "'many' is not a valid integer"),
        (["--prompt-logprobs", "--no-prompt-logprobs"], "contradict"),
    ]:
        result = CliRunner().invoke(
            cli, ["validate", *args, "--output", str(tmp_path / "b"), *flags]
        )
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.splitlines()) == 1, result.output
    with pytest.raises(JobError, match="logprobs"):
        JobSpec.from_keys(dict(input="i", output="o", target="t", logprobs=True))  # type: ignore[arg-type]
    keys = {"input": "i", "output": "o", "target": "t"}
    with pytest.raises(JobError, match="job key 'prompt_logprobs': -1 is less than"):
        JobSpec.from_keys(dict(**keys, prompt_logprobs=-1))
    with pytest.raises(JobError, match="job key 'prompt_logprobs'"):
        JobSpec.from_keys(dict(**keys, prompt_logprobs="2"))  # type: ignore[arg-type]
    assert JobSpec.from_keys(dict(**keys, prompt_logprobs=True)).output.prompt_logprobs == 0
    assert JobSpec.from_keys(dict(**keys, prompt_logprobs=False)).output.prompt_logprobs is None


def test_the_ray_processor_writes_the_same_columns(tmp_path: Path, target: Path) -> None:
    write_input(tmp_path / "in")
    job = make_job(tmp_path, target, logprobs=2, prompt_logprobs=2)
    run_job(job)
    local = pl.read_parquet(sorted((tmp_path / "out").glob("part-*.parquet"))).sort("row_index")
    processor = BatchrunProcessor(
        target=str(target),
        max_tokens=6,
        max_batch_size=3,
        device="cpu",
        logprobs=2,
        prompt_logprobs=2,
    )
    table = pq.read_table(tmp_path / "in" / "in.parquet")
    got = pl.from_arrow(processor(table))
    assert isinstance(got, pl.DataFrame)
    assert got.schema == local.schema
    for name in (
        "completion_token_ids",
        "completion_logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "prompt_top_logprobs",
    ):
        assert got[name].to_list() == local[name].to_list(), name
