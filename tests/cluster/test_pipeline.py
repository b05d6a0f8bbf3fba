"""run_job over a fake engine: exactly-once output, error rows, bounded queue, resume, shards.

The fake follows the Engine interface and generates a fixed function of each prompt, finishing
requests out of order, so these tests check the IO logic without a model.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerBase

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request, Status, sample_requests
from batchrun.errors import JobError
from batchrun.runners.engine_feed import QUEUE_FACTOR, EngineLike
from batchrun.runners.local import run_job


class FakeEngine:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        block_size: int | None = None,
        max_model_len: int = 96,
        batch: int = 3,
        fail_at_step: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.block_size = block_size
        self.batch = batch
        self.fail_at_step = fail_at_step
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.steps = 0
        self.added = 0
        self.max_unfinished = 0

    def info(self) -> dict[str, Any]:
        return {
            "target": "fake-target",
            "draft": "fake-draft" if self.block_size else None,
            "dtype": "float32",
            "device": "cpu",
            "attention_backend": "torch",
        }

    @property
    def max_batch_size(self) -> int:
        return self.batch

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        assert request.state.status is Status.WAITING and not request.output.token_ids
        self.added += 1
        self.waiting += sample_requests(request)  # as the engine does: n samples
        self.max_unfinished = max(self.max_unfinished, self.num_unfinished)

    def step(self) -> list[Request]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("fake engine failure")
        while len(self.running) < self.batch and self.waiting:
            self.running.append(self.waiting.pop(0))
        for request in self.running:
            self._advance(request)
        finished = [r for r in self.running if r.state.status is Status.FINISHED]
        self.running = [r for r in self.running if r.state.status is not Status.FINISHED]
        return finished

    def _advance(self, request: Request) -> None:
        if not request.output.token_ids:  # prefill: one token, no round
            if self.block_size is not None:
                request.output.spec_hist = [0] * self.block_size
            self._emit(request, 1)
            return
        if self.block_size is None:
            self._emit(request, 1)
            return
        assert request.output.spec_hist is not None
        committed = self._emit(
            request, 1 + (request.row_index + request.num_tokens) % self.block_size
        )
        request.output.spec_hist[committed - 1] += 1
        request.output.spec_rounds += 1

    def _emit(self, request: Request, count: int) -> int:
        for emitted in range(1, count + 1):
            token = fake_token(request.prompt_ids, len(request.output.token_ids), self.vocab_size)
            request.output.token_ids.append(token)
            if token in request.params.stop_token_ids:
                self._finish(request, "stop")
            elif (
                len(request.output.token_ids) >= request.params.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                self._finish(request, "length")
            if request.state.status is Status.FINISHED:
                return emitted
        return count

    def abort_all(self) -> None:
        self.waiting, self.running = [], []

    def _finish(self, request: Request, reason: str) -> None:
        request.state.status = Status.FINISHED
        request.output.finish_reason = reason
        text = self.tokenizer.decode(request.output.token_ids, skip_special_tokens=True)
        assert isinstance(text, str)
        request.output.completion = text


def fake_token(prompt_ids: list[int], position: int, vocab_size: int) -> int:
    return 10 + (sum(prompt_ids) * 31 + position * 7) % (vocab_size - 10)


# The fake satisfies the protocol the pipeline is typed against.
_: type[EngineLike] = FakeEngine


BAD_ROWS = {
    3: (None, None, "prompt is null"),
    8: ("", None, "prompt is empty"),
    11: ("ok prompt", 0, "max_tokens must be an integer >= 1"),
    17: ("x " * 200, None, "the model's context is 96"),
}


def write_input(directory: Path, rows: int = 40, files: int = 2) -> pa.Table:
    """Rows with assorted pass-through types, split over several files; BAD_ROWS are bad."""
    prompts: list[str | None] = [f"def function_{i}(x):" for i in range(rows)]
    max_tokens: list[int | None] = [1 + (i * 5) % 9 for i in range(rows)]
    for index, (prompt, tokens, _) in BAD_ROWS.items():
        if index < rows:
            prompts[index], max_tokens[index] = prompt, tokens
    start = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    table = pa.table(
        {
            "key": pa.array([f"k{i}" for i in range(rows)], pa.large_string()),
            "prompt": pa.array(prompts, pa.string()),
            "max_tokens": pa.array(max_tokens, pa.int32()),
            "when": pa.array(
                [start + datetime.timedelta(hours=i) for i in range(rows)],
                pa.timestamp("ms", "UTC"),
            ),
            "tags": pa.array([[i, i + 1] for i in range(rows)], pa.list_(pa.int16())),
            "meta": pa.array([{"a": i, "b": str(i)} for i in range(rows)]),
            "lang": pa.array(
                ["py", "c", "go"] * (rows // 3) + ["py"] * (rows % 3)
            ).dictionary_encode(),
        }
    )
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for number in range(files):
        part = table.slice(number * per_file, per_file)
        pq.write_table(part, directory / f"in-{number}.parquet", row_group_size=7)
    return table


def make_job(tmp_path: Path, **keys: Any) -> JobSpec:
    (tmp_path / "model").mkdir(exist_ok=True)
    defaults = {
        "input": str(tmp_path / "in"),
        "output": str(tmp_path / "out"),
        "target": str(tmp_path / "model"),
        "rows_per_part": 6,
        "max_batch_size": 2,
        "id_column": "key",
        "quiet": True,
    }
    return JobSpec.from_keys(dict(**{**defaults, **keys}))


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    schemas = {pq.read_schema(p).to_string() for p in parts}
    assert len(schemas) == 1, "every part has the same schema"
    table = pa.concat_tables(pq.read_table(p) for p in parts)
    return table.sort_by("row_index")


def test_every_row_comes_out_exactly_once(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    source = write_input(tmp_path / "in")
    engine = FakeEngine(tokenizer)
    stats = run_job(make_job(tmp_path), engine)
    out = read_output(tmp_path / "out")
    assert out.column("row_index").to_pylist() == list(range(source.num_rows))
    passed = out.select(source.column_names)  # pass-through columns, unchanged
    assert passed.schema.equals(source.schema) and passed.to_pylist() == source.to_pylist()
    for row in out.to_pylist():
        index = row["row_index"]
        if index in BAD_ROWS:
            assert row["finish_reason"] == "error" and BAD_ROWS[index][2] in row["error"]
            assert row["completion"] is None and row["completion_tokens"] == 0
            continue
        ids = tokenizer.encode(row["prompt"])
        expected = [fake_token(ids, i, len(tokenizer)) for i in range(row["max_tokens"])]
        assert row["completion_token_ids"] == expected
        assert row["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (len(ids), len(expected))
        assert (row["finish_reason"], row["error"], row["spec_rounds"]) == ("length", None, 0)
        assert row["spec_accept_hist"] is None and row["acceptance_length"] is None
    assert engine.added == source.num_rows - len(BAD_ROWS)
    assert engine.max_unfinished <= QUEUE_FACTOR * engine.max_batch_size  # the queue is bounded
    assert stats == json.loads((tmp_path / "out/stats.json").read_text())
    ok = [r for r in out.to_pylist() if r["error"] is None]
    assert (stats["rows"], stats["ok_rows"], stats["error_rows"]) == (40, 40 - 4, 4)
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert stats["finish_reasons"] == {"error": 4, "length": 36}
    assert stats["acceptance_length"] is None and stats["block_size"] is None
    assert stats["target"] == "fake-target" and set(stats["versions"]) >= {"torch", "python"}
    assert (tmp_path / "out/_SUCCESS").exists()


def test_draft_statistics(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    write_input(tmp_path / "in", rows=20)
    stats = run_job(make_job(tmp_path, max_tokens=12), FakeEngine(tokenizer, block_size=4))
    rows = [r for r in read_output(tmp_path / "out").to_pylist() if r["error"] is None]
    pooled = [0] * 4
    for row in rows:
        hist = row["spec_accept_hist"]
        assert len(hist) == 4 and sum(hist) == row["spec_rounds"]
        assert row["completion_tokens"] == 1 + sum(k * hist[k - 1] for k in range(1, 5))
        if row["spec_rounds"]:
            tau = (row["completion_tokens"] - 1) / row["spec_rounds"]
            assert row["acceptance_length"] == pytest.approx(tau)
        else:  # max_tokens 1: the prefill token only
            assert row["acceptance_length"] is None and hist == [0, 0, 0, 0]
        pooled = [a + b for a, b in zip(pooled, hist, strict=True)]
    rounds = sum(pooled)
    assert stats["spec_rounds"] == rounds and stats["block_size"] == 4
    assert stats["acceptance_length"] == pytest.approx(
        sum(r["completion_tokens"] - 1 for r in rows) / rounds
    )
    assert stats["per_position_acceptance"] == pytest.approx(
        [sum(pooled[j:]) / rounds for j in range(1, 4)]
    )


def test_resume_after_a_failure_equals_an_uninterrupted_run(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in")
    reference = tmp_path / "reference"
    run_job(make_job(tmp_path, output=str(reference)), FakeEngine(tokenizer))
    with pytest.raises(RuntimeError, match="fake engine failure"):
        run_job(make_job(tmp_path), FakeEngine(tokenizer, fail_at_step=12))
    partial = read_output(tmp_path / "out")
    assert 0 < partial.num_rows < 40 and not (tmp_path / "out/_SUCCESS").exists()
    resumed = FakeEngine(tokenizer)
    stats = run_job(make_job(tmp_path), resumed)
    assert resumed.added < 40 - len(BAD_ROWS)  # committed rows were skipped
    assert read_output(tmp_path / "out").equals(read_output(reference))
    assert stats["rows"] == 40 and (tmp_path / "out/_SUCCESS").exists()
    again = FakeEngine(tokenizer)
    run_job(make_job(tmp_path), again)  # a finished job has nothing left to do
    assert again.added == 0 and read_output(tmp_path / "out").num_rows == 40


def test_an_empty_input_finishes_at_once(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "in" / "e.parquet")
    stats = run_job(make_job(tmp_path, id_column=None), FakeEngine(tokenizer))
    assert stats["rows"] == 0 and (tmp_path / "out" / "_SUCCESS").exists()


def test_part_seconds_commits_a_part_before_it_is_full(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in", rows=12, files=1)
    run_job(make_job(tmp_path, rows_per_part=1000, part_seconds=1e-9), FakeEngine(tokenizer))
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) > 1
    assert read_output(tmp_path / "out").column("row_index").to_pylist() == list(range(12))


def test_shards_share_one_output_directory(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in", rows=21)  # row groups of 7, 4 | 7, 3 rows in two files
    first = run_job(make_job(tmp_path, shard="0/2"), FakeEngine(tokenizer))
    assert first["rows"] == 11 and first["shard"] == "0/2"
    assert read_output(tmp_path / "out").column("row_index").to_pylist() == list(range(11))
    assert not (tmp_path / "out/_SUCCESS").exists() and not (tmp_path / "out/stats.json").exists()
    run_job(make_job(tmp_path, shard="1/2"), FakeEngine(tokenizer))
    assert read_output(tmp_path / "out").column("row_index").to_pylist() == list(range(21))
    assert (tmp_path / "out/_SUCCESS").exists()
    job_stats = json.loads((tmp_path / "out/stats.json").read_text())
    assert job_stats["rows"] == 21 and job_stats["error_rows"] == 4


def test_a_different_job_is_refused_and_overwrite_replaces_it(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in", rows=8, files=1)
    run_job(make_job(tmp_path), FakeEngine(tokenizer))
    with pytest.raises(JobError, match="different job"):
        run_job(make_job(tmp_path, temperature=0.7), FakeEngine(tokenizer))
    run_job(make_job(tmp_path, temperature=0.7, overwrite=True), FakeEngine(tokenizer))
    assert read_output(tmp_path / "out").num_rows == 8


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"prompt_column": "nope"}, "prompt_column 'nope' is not an input column"),
        ({"id_column": "nope"}, "id_column 'nope'"),
        ({"input": "/nonexistent/in.parquet"}, "does not exist"),
        ({"target": "/nonexistent/model"}, "target model directory"),
    ],
)
def test_startup_failures_happen_before_any_work(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase, keys: dict[str, str], message: str
) -> None:
    write_input(tmp_path / "in", rows=4, files=1)
    engine = FakeEngine(tokenizer)
    with pytest.raises(JobError, match=message):
        run_job(make_job(tmp_path, **keys), engine)
    assert engine.added == 0 and not (tmp_path / "out").exists()


def test_error_log_names_the_first_rows_then_says_more_follow() -> None:
    from batchrun.io.output.progress_bar import MAX_LOGGED_ERRORS, ErrorLog

    class Bar:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def log(self, line: str) -> None:
            self.lines.append(line)

    bar = Bar()
    log = ErrorLog(bar, quiet=False, id_column="id")  # type: ignore[arg-type]
    for i in range(MAX_LOGGED_ERRORS + 5):
        log.log(i, {"id": f"r{i}"}, "prompt is empty")
    assert bar.lines[0] == "batchrun: row 0 (id='r0'): prompt is empty"
    assert len(bar.lines) == MAX_LOGGED_ERRORS + 1 and "more error rows follow" in bar.lines[-1]
    quiet = Bar()
    ErrorLog(quiet, quiet=True, id_column=None).log(0, {}, "x")  # type: ignore[arg-type]
    assert quiet.lines == []
