"""The batch a job runs at (engine/batch_choice.py): given, or chosen at start-up from the rows'
length, the device's rates and memory; validate says it, stats.json records it, and the
fingerprint does not hold it (a job resumes whatever its batch)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import batchrun.engine.batch_choice
from batchrun.bench.replay.job import Job, replay
from batchrun.bench.shapes import SHAPES
from batchrun.config.job import JobSpec
from batchrun.engine.batch_choice import (
    CPU_BATCH_SIZE,
    BatchChoice,
    RowTokens,
    choose_batch,
    decode_cost,
    job_batch,
)
from batchrun.engine.batch_size import DecodeCost
from batchrun.engine.config import EngineConfig
from batchrun.engine.device_rates import Ceilings
from batchrun.errors import JobError
from batchrun.runners.opened_job import open_job
from tests.engine.test_batch_size import FIXTURES, WEIGHT_BYTES, h100_costs, h100_pages
from tests.job.test_cli import invoke, write_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
PROMPTS = ["def f(x):", "import os", "a longer prompt than the others, by some words", None]


def no_cost() -> DecodeCost:
    raise AssertionError("a given or CPU batch measures nothing")


def h100_rule(rows: RowTokens) -> BatchChoice:
    """choose_batch on the H100, as start-up feeds it: the rates its bench run measured (the
    fixture's ceilings), Qwen3-8B's bfloat16 weights, the pages memory.py sizes on 80 GB."""
    ceilings = Ceilings(
        **json.loads((FIXTURES / "h100-jobs-w2-b1-drafts.json").read_text())["ceilings"]
    )
    cost = lambda: decode_cost(SHAPES["qwen3-8b"], WEIGHT_BYTES, 2, 2, ceilings)  # noqa: E731
    return choose_batch(None, CUDA, rows, cost, h100_pages, page_size=16)


def test_on_the_h100_w1_gets_the_batch_the_fitted_replay_ranks_best() -> None:
    """W1 (1,024 in, 256 out) with the H100's measured rates: the batch chosen is the one of the
    sweep 64, 128, 256 that the replay fitted to the H100's step times runs fastest."""
    choice = h100_rule(RowTokens(1024, 256, "W1"))
    sweep = (64, 128, 256)
    played = {
        b: replay(Job(rows=256, prompt_len=1024, max_tokens=256, batch=b), None, costs=h100_costs())
        for b in sweep
    }
    best = max(sweep, key=lambda b: played[b].tokens_per_second)
    assert choice.chosen and choice.size == best
    assert "1024 + 256 tokens (W1)" in choice.why


def test_rows_of_the_whole_context_get_fewer_requests() -> None:
    """Unknown rows are sized as the model's whole context: their pages bound the batch lower."""
    known = h100_rule(RowTokens(1024, 256, "W1"))
    unknown = h100_rule(RowTokens.unknown(40960, 256))
    assert unknown.size < known.size


def test_a_given_batch_wins_and_a_cpu_keeps_64() -> None:
    rows = RowTokens(1024, 256, "W1")
    given = choose_batch(128, CUDA, rows, no_cost, h100_pages, page_size=16)
    assert (given.size, given.chosen) == (128, False)
    cpu = choose_batch(None, torch.device("cpu"), rows, no_cost, h100_pages, page_size=16)
    assert (cpu.size, cpu.chosen) == (CPU_BATCH_SIZE, True) == (64, True)


def test_a_gpu_without_room_to_measure_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object) -> Ceilings:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(batchrun.engine.batch_choice, "measure_ceilings", full)
    config = EngineConfig(target=Path("unused"))
    rows = RowTokens(1024, 256, "W1")
    with pytest.raises(JobError, match="no 2 GiB free .*; set --max-batch-size$"):
        job_batch(config, SHAPES["qwen3-8b"], None, torch.bfloat16, CUDA, WEIGHT_BYTES, rows)
    given = replace(config, max_batch_size=32)
    assert job_batch(given, SHAPES["qwen3-8b"], None, torch.bfloat16, CUDA, 0, rows).size == 32


def write_job(tmp_path: Path, model: Path, extra: str = "") -> Path:
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{model}"\nquiet = true\nmax_tokens = 4\n' + extra
    )
    return job


def test_validate_says_the_batch_and_why(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    chosen = invoke("validate", str(write_job(tmp_path, tiny_model)))
    assert chosen.exit_code == 0, chosen.output
    assert "batch: 64 requests (chosen: a CPU's fixed batch), 4096 tokens per forward" in (
        chosen.output
    )
    given = invoke("validate", str(write_job(tmp_path, tiny_model)), "--max-batch-size", "3")
    assert "batch: 3 requests (given (max_batch_size)), " in given.output


def test_stats_records_the_batch_and_a_job_resumes_at_another(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A run at a given batch, then the same job with none (chosen): not refused as another
    job, and stats.json says the batch each ran and how it came."""
    write_prompts(tmp_path / "in", PROMPTS)
    job = str(write_job(tmp_path, tiny_model, "rows_per_part = 2\n"))
    first = invoke("run", job, "--max-batch-size", "2")
    assert first.exit_code == 0, first.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (stats["max_batch_size"], stats["max_batch_size_chosen"]) == (2, False)
    (tmp_path / "out" / "_SUCCESS").unlink()
    part = sorted((tmp_path / "out").glob("part-*.parquet"))[-1]
    part.unlink()  # a row group left to redo, at the chosen batch
    second = invoke("run", job)
    assert second.exit_code == 0, second.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (stats["max_batch_size"], stats["max_batch_size_chosen"]) == (64, True)
    assert stats["rows"] == len(PROMPTS)


def test_the_batch_is_in_no_fingerprint(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    keys = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    keys["target"] = str(tiny_model)
    unset = open_job(JobSpec.from_keys(keys)).fingerprint
    assert open_job(JobSpec.from_keys({**keys, "max_batch_size": 8})).fingerprint == unset


def test_the_rows_length_comes_from_the_first_rows_as_the_run_builds_them(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The longest prompt in tokens and the largest max_tokens (a row's own column counts);
    a row that cannot run (a null prompt) says nothing; no row that runs: None."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    (tmp_path / "in").mkdir()
    table = pa.table({"prompt": pa.array(PROMPTS, pa.string()), "max_tokens": [3, 9, None, 500]})
    pq.write_table(table, tmp_path / "in" / "0.parquet")
    keys = {"input": str(tmp_path / "in"), "output": str(tmp_path / "out")}
    opened = open_job(JobSpec.from_keys({**keys, "target": str(tiny_model), "max_tokens": 5}))
    rows = opened.row_tokens(tokenizer, 4096, len(tokenizer))
    assert rows is not None
    assert rows.prompt == max(len(tokenizer.encode(p)) for p in PROMPTS if p is not None)
    assert rows.output == 9  # the null prompt's 500 never runs; the third row takes the job's 5
    assert rows.source == "the input's first 3 rows"
    pq.write_table(table.slice(3), tmp_path / "in" / "0.parquet")
    assert (
        open_job(JobSpec.from_keys({**keys, "target": str(tiny_model)})).row_tokens(
            tokenizer, 4096, len(tokenizer)
        )
        is None
    )
