"""The seams every runner shares: the row sources (a fixed range, chunk claims, Ray's row
groups) give the same rows, the row pipeline turns them into requests and output rows alike for
every runner, and a job whose engines ran elsewhere (--workers) ends through the sink."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from batchrun.engine.core.requests import Request
from batchrun.io.input.reader import RowSelection, open_input
from batchrun.io.output.directory import OutputDir
from batchrun.io.output.sink import OutputSink, RunFacts
from batchrun.io.output.stats import RunClock, Timing
from batchrun.runners.engine_feed import generate
from batchrun.runners.opened_job import open_job
from batchrun.runners.row_pipeline import RowPipeline, request_builder
from batchrun.runners.row_sources import FixedRows, RowGroups, RowSource
from batchrun.runners.workers.chunks import ChunkPuller, plan_chunks
from tests.cluster.test_pipeline import BAD_ROWS, FakeEngine, make_job, write_input


def source_rows(source: RowSource) -> list[tuple[int, str | None]]:
    """(row_index, prompt) of every row a source gives, sorted."""
    rows = []
    for batch in source.batches():
        prompts = batch.batch.column("prompt").to_pylist()
        rows += zip(batch.row_indices.tolist(), prompts, strict=True)
    source.release()
    return sorted(rows)


def test_every_row_source_gives_the_rows_not_done(tmp_path: Path) -> None:
    table = write_input(tmp_path / "in")  # row groups of 7 rows over two files
    source = open_input(str(tmp_path / "in"))
    done = np.zeros(source.total_rows, dtype=bool)
    done[[0, 5, 6, 7, 13, 30]] = True  # committed by an earlier run
    want = [(i, p) for i, p in enumerate(table.column("prompt").to_pylist()) if not done[i]]
    out = OutputDir.at(str(tmp_path / "out"))
    chunks = plan_chunks(source, 4)
    sources: list[RowSource] = [
        FixedRows(source, RowSelection(done.copy())),
        RowGroups(RowGroups.plan(source, done), batch_rows=3),
        ChunkPuller(source, out, chunks, 4, done.copy(), (0, 1)),
    ]
    for row_source in sources:
        assert source_rows(row_source) == want, type(row_source).__name__


def test_the_pipeline_orders_windows_and_gathers_samples(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in", rows=20, files=1)
    job = make_job(tmp_path, n=2, schedule_window=6)
    opened = open_job(job)
    engine = FakeEngine(tokenizer)
    builder = request_builder(job, opened.prompt, opened.source.schema, engine)
    pipeline = RowPipeline(job, engine, window=6)
    selection = RowSelection(np.zeros(opened.source.total_rows, dtype=bool))
    rows = list(pipeline.rows(FixedRows(opened.source, selection).batches(), builder))
    assert sorted(row.row_index for row in rows) == list(range(20))
    assert [row.seq for row in rows if row.row_index == 19] == [19]  # the order rows were read
    for start in range(0, 20, 6):  # in each window, the rows that cannot run come first
        runs = [isinstance(row.request, Request) for row in rows[start : start + 6]]
        assert runs == sorted(runs)
    bad = [row for row in rows if not isinstance(row.request, Request)]
    assert sorted(row.row_index for row in bad) == sorted(i for i in BAD_ROWS if i < 20)
    for row in bad:
        out = RowPipeline.error_rows(row)  # one per sample the row would have had
        assert [(r.row_index, r.sample_index) for r in out] == [
            (row.row_index, 0),
            (row.row_index, 1),
        ]
    requests = iter([row.request for row in rows if isinstance(row.request, Request)])
    finished: dict[int, list[int]] = {}
    for step in generate(engine, requests, max_queued=4):
        for request in step:
            done = pipeline.finished(request.row_index, request)
            if done is not None:
                assert request.row_index not in finished
                finished[request.row_index] = [r.sample_index for r in done]
    assert finished == {row.row_index: [0, 1] for row in rows if row not in bad}


def test_a_run_whose_engines_ran_elsewhere_ends_through_the_sink(tmp_path: Path) -> None:
    """The parent of --workers: stats over every part, its workers' tokens and timing."""
    write_input(tmp_path / "in", rows=0, files=1)
    opened = open_job(make_job(tmp_path))
    opened.out.acquire()
    opened.prepare_output()
    timing = Timing(9.0, 2.0, 7.0)
    facts = RunFacts({"target": "t"}, None, {"workers": 2}, timing=timing)
    sink = OutputSink(opened.sink_target(), clock=RunClock(), facts=lambda: facts)
    with sink.writing():
        sink.count(30, None, 0)
        sink.count(12, None, 0)
    finished = sink.finish()
    opened.out.release()
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert finished.missing_rows == 0 and (tmp_path / "out" / "_SUCCESS").exists()
    assert stats == finished.stats and stats["workers"] == 2
    seconds = (stats["wall_seconds"], stats["load_seconds"], stats["generation_seconds"])
    assert seconds == (9.0, 2.0, 7.0) and stats["output_tokens_per_second"] == 6.0  # 42 / 7
    parts = list((tmp_path / "out").glob("part-*.parquet"))
    assert len(parts) == 1 and pq.read_table(parts[0]).num_rows == 0  # the schema, for readers
