"""Length-aware ordering (--schedule-window): the admission order of a window (shared prefixes
side by side, the longest first), then whole jobs: the same output for every row with the
window on and off, shards and resume still writing each row exactly once."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerBase

from batchrun.config.job import JobSpec
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.runners.admission_order import admission_order
from batchrun.runners.local import run_job
from batchrun.runners.row_pipeline import windowed
from batchrun.sampling.params import SamplingParams
from tests.cluster.test_pipeline import BAD_ROWS, FakeEngine, write_input

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE_SIZE = EngineConfig.page_size  # a job's KV page


def request(row: int, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(row, prompt, SamplingParams(max_tokens=max_tokens))


def page(token: int) -> list[int]:
    return [token] * PAGE_SIZE


def test_rows_sharing_pages_come_together_and_the_longest_branch_first() -> None:
    a, b = page(1) + page(2), page(1) + page(3)  # share one page, then part
    rows = [
        request(0, a + [5]),
        request(1, page(9) + [1]),  # alone, short
        request(2, b + [7], max_tokens=40),  # the longest: its branch of page(1) goes first
        request(3, a + [4]),
        request(4, page(8) + [1], max_tokens=20),  # alone, long
        request(5, b + [6]),
        request(6, a + [4]),  # the same prompt as row 3: kept in input order
        request(7, [1, 1, 1]),  # less than a page: shares nothing with page(1) prompts
    ]
    order = [r.row_index for r in admission_order(rows, max_len=1000, page_size=PAGE_SIZE)]
    assert order == [2, 5, 3, 6, 0, 4, 1, 7]
    # The context caps a request's length: capped at 30, all but rows 1 and 7 tie, and ties
    # keep token order.
    capped = admission_order(rows, max_len=30, page_size=PAGE_SIZE)
    assert [r.row_index for r in capped] == [3, 6, 0, 5, 2, 4, 1, 7]


def test_windows_reorder_only_within_themselves() -> None:
    rows = [request(i, page(10 - i), max_tokens=1 + i) for i in range(7)]

    def same(r: Request) -> Request:
        return r

    assert list(windowed(iter(rows), 0, 1000, PAGE_SIZE, same)) == rows  # 0: input order
    assert admission_order([], 1000, PAGE_SIZE) == []
    ordered = [r.row_index for r in windowed(iter(rows), 3, 1000, PAGE_SIZE, same)]
    assert ordered == [2, 1, 0, 5, 4, 3, 6]  # within each window of 3, the longest first
    # Rows without a request (error rows) come first in their window, as they come.
    items = [(r, r if r.row_index % 3 else None) for r in rows]
    with_errors = windowed(iter(items), 4, 1000, PAGE_SIZE, lambda item: item[1])
    order = [r.row_index for r, _ in with_errors]
    assert order == [0, 3, 2, 1, 6, 5, 4]
    long_prompts = [request(i, page(1) * 400 + [i % 2]) for i in range(4)]  # 400 shared pages
    assert [r.row_index for r in admission_order(long_prompts, 10**6, PAGE_SIZE)] == [0, 2, 1, 3]


def test_pages_are_the_page_size_given() -> None:
    """Prompts that share half a page of 16 tokens share a whole page of 8."""
    half = [1] * 8
    rows = [request(0, half + [2] * 8), request(1, [3] * 16, 20), request(2, half + [4] * 8, 40)]
    # Pages of 16: nothing shared, so longest first.
    assert [r.row_index for r in admission_order(rows, 1000, page_size=16)] == [2, 1, 0]
    # Pages of 8: rows 0 and 2 share their first page, so row 0 follows row 2.
    assert [r.row_index for r in admission_order(rows, 1000, page_size=8)] == [2, 0, 1]


# -- jobs -----------------------------------------------------------------------------------


PREFIXES = 3


def write_token_rows(directory: Path, rows: int) -> None:
    """Rows of token ids whose prompts start with one of three shared prefixes, in turn (so
    that input order never puts two of a prefix side by side); every third row sampled."""
    prefixes = [[100 + 7 * p + i % 5 for i in range(2 * PAGE_SIZE + 5)] for p in range(PREFIXES)]
    prompts = [prefixes[i % PREFIXES] + [300 + i, 400 + i % 7] for i in range(rows)]
    table = pa.table(
        {
            "prompt_token_ids": pa.array(prompts, pa.list_(pa.int32())),
            "temperature": pa.array([0.8 if i % 3 == 2 else None for i in range(rows)]),
            "max_tokens": pa.array([4 + (i * 5) % 7 for i in range(rows)], pa.int64()),
        }
    )
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "in.parquet", row_group_size=5)


class RecordingEngine(Engine):
    """The engine, recording the rows in the order they are added."""

    added: list[int]

    def add(self, request: Request) -> None:
        self.added.append(request.row_index)
        super().add(request)


def run_recorded(job: JobSpec) -> tuple[pa.Table, list[int]]:
    engine = RecordingEngine(job.engine_config())
    engine.added = []
    run_job(job, engine)
    parts = sorted(Path(job.output.directory).glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index"), engine.added


def test_ordering_changes_no_output_and_groups_shared_prefixes(
    tmp_path: Path, tiny_model: Path
) -> None:
    rows = 24
    write_token_rows(tmp_path / "in", rows)
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "ordered"),
            target=str(tiny_model),
            max_batch_size=4,
            rows_per_part=5,
            schedule_window=12,
            n=2,
            quiet=True,
            device="cpu",
            dtype="float32",
            attention_backend="torch",
        )
    )
    ordered, order = run_recorded(job)
    plain, plain_order = run_recorded(
        job.with_keys(schedule_window=0, output=str(tmp_path / "plain"))
    )
    assert plain_order == list(range(rows))
    assert sorted(order) == list(range(rows)) and order != plain_order
    for start in (0, 12):  # a window's rows, each prefix's side by side
        window = order[start : start + 12]
        assert sorted(window) == list(range(start, start + 12))
        groups = [row % PREFIXES for row in window]
        assert groups == sorted(groups, key=groups.index)  # contiguous runs
    by_sample = [("row_index", "ascending"), ("sample_index", "ascending")]
    columns = ["row_index", "sample_index", "completion_token_ids", "finish_reason"]
    assert (
        ordered.select(columns).sort_by(by_sample).equals(plain.select(columns).sort_by(by_sample))
    )


def test_shards_with_ordering_write_each_row_once(tmp_path: Path, tiny_model: Path) -> None:
    rows = 20
    write_token_rows(tmp_path / "in", rows)
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tiny_model),
            max_batch_size=3,
            rows_per_part=4,
            schedule_window=8,
            quiet=True,
        )
    )
    whole, _ = run_recorded(job.with_keys(output=str(tmp_path / "whole")))
    orders = [run_recorded(job.with_keys(shard=f"{i}/2"))[1] for i in range(2)]
    assert sorted(orders[0] + orders[1]) == list(range(rows))  # each row in one shard, once
    assert orders[0] != sorted(orders[0])  # reordered within the shard's rows
    sharded = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "out").glob("part-*")))
    assert sharded.sort_by("row_index").equals(whole)
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_resume_copes_with_rows_committed_out_of_input_order(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in")
    (tmp_path / "model").mkdir()
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tmp_path / "model"),
            rows_per_part=4,
            max_batch_size=2,
            schedule_window=16,
            quiet=True,
        )
    )
    run_job(job.with_keys(output=str(tmp_path / "reference")), FakeEngine(tokenizer))
    with pytest.raises(RuntimeError, match="fake engine failure"):
        run_job(job, FakeEngine(tokenizer, fail_at_step=14))
    committed = read(tmp_path / "out").column("row_index").to_pylist()
    ok_rows = [row for row in committed if row not in BAD_ROWS]
    assert ok_rows != list(range(len(ok_rows)))  # not a prefix of the input: out of order
    resumed = FakeEngine(tokenizer)
    run_job(job, resumed)
    assert resumed.added == 40 - len(BAD_ROWS) - len(ok_rows)  # exactly the rest
    assert read(tmp_path / "out").equals(read(tmp_path / "reference"))


def read(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")
