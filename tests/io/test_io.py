"""Parquet in (streaming, row_index, shards), prompts to requests, part files and resume state."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request, row_seed
from batchrun.errors import JobError
from batchrun.io.input.listing import resolve_input_paths
from batchrun.io.input.prompts import PromptKind, RequestBuilder, find_id_column, find_prompt_column
from batchrun.io.input.reader import RowSelection, iter_batches, open_input
from batchrun.io.input.shards import shard_rows
from batchrun.io.output.columns import build_table, error_row, finished_row, output_schema
from batchrun.io.output.directory import OutputDir, row_ranges
from batchrun.io.output.progress_bar import ProgressBar
from batchrun.sampling.params import SamplingParams


def make_job(**keys: Any) -> JobSpec:
    return JobSpec.from_keys(dict(**{"input": "in", "output": "out", "target": "model", **keys}))


def write_files(directory: Path, sizes: list[int], row_group_size: int = 3) -> list[Path]:
    """Files whose `n` column holds the global row number, written in shuffled name order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for number, size in enumerate(sizes):
        path = directory / f"f{number:02d}.parquet"
        prompts = pa.array([f"row {i}" for i in range(start, start + size)], pa.string())
        table = pa.table({"prompt": prompts})
        table = table.append_column("n", pa.array(range(start, start + size), pa.int64()))
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
        start += size
    return paths


def read_all(spec: str, selection: RowSelection | None = None) -> tuple[list[int], list[int]]:
    source = open_input(spec)
    selection = selection or RowSelection(np.zeros(source.total_rows, dtype=bool))
    indices: list[int] = []
    numbers: list[int] = []
    for batch in iter_batches(source, selection):
        indices += batch.row_indices.tolist()
        numbers += batch.batch.column("n").to_pylist()
    return indices, numbers


# -- reader -------------------------------------------------------------------------------------


def test_directory_and_glob_stream_in_path_order(tmp_path: Path) -> None:
    write_files(tmp_path / "data", [5, 0, 7, 4])
    (tmp_path / "data" / "_meta.parquet").write_text("not parquet")  # hidden from directories
    for spec in [str(tmp_path / "data"), str(tmp_path / "data" / "f*.parquet")]:
        source = open_input(spec)
        assert source.total_rows == 16
        assert [f.first_row for f in source.files] == [0, 5, 5, 12]
        indices, numbers = read_all(spec)
        assert indices == numbers == list(range(16))


def test_single_file_and_sorting_by_path(tmp_path: Path) -> None:
    paths = write_files(tmp_path, [2, 2])
    assert resolve_input_paths(str(paths[1])) == [paths[1]]
    assert resolve_input_paths(str(tmp_path / "*.parquet")) == paths


def test_shard_and_done_rows_are_skipped(tmp_path: Path) -> None:
    write_files(tmp_path, [10, 10])  # row groups of 3, 3, 3 and 1 rows in each file
    source = open_input(str(tmp_path))
    assert shard_rows(source, (0, 2)) == range(0, 10)
    assert shard_rows(source, (1, 3)) == range(6, 13)  # the groups whose middle row is 7 to 13
    done = np.zeros(20, dtype=bool)
    done[[0, 3, 4, 18]] = True
    indices, numbers = read_all(str(tmp_path), RowSelection(done, range(0, 10)))
    assert indices == numbers == [i for i in range(10) if i not in (0, 3, 4)]
    indices, numbers = read_all(str(tmp_path), RowSelection(done, range(6, 13)))
    assert indices == numbers == list(range(6, 13))
    assert RowSelection(done, range(6, 13)).count() == 7
    assert RowSelection(done, range(13, 20)).count() == 6


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing.parquet", "does not exist"),
        ("empty_dir", "holds no .parquet files"),
        ("nothing*.parquet", "matches no files"),
        ("junk.parquet", "cannot read input file"),
    ],
)
def test_unreadable_input_is_a_job_error(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "junk.parquet").write_text("definitely not parquet")
    with pytest.raises(JobError, match=message):
        open_input(str(tmp_path / spec))


def test_files_with_different_columns_are_a_job_error(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": [1]}), tmp_path / "b.parquet")
    with pytest.raises(JobError, match="b.parquet.*has columns"):
        open_input(str(tmp_path))


# -- prompt columns -----------------------------------------------------------------------------

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.mark.parametrize(
    ("columns", "flags", "expected"),
    [
        ({"prompt": pa.string()}, {}, (PromptKind.TEXT, "prompt")),
        ({"messages": MESSAGES}, {}, (PromptKind.MESSAGES, "messages")),
        (
            {"prompt_token_ids": pa.list_(pa.int32())},
            {},
            (PromptKind.TOKEN_IDS, "prompt_token_ids"),
        ),
        (
            {"q": pa.large_string(), "prompt": pa.int8()},
            {"prompt_column": "q"},
            (PromptKind.TEXT, "q"),
        ),
        ({"chat": MESSAGES}, {"messages_column": "chat"}, (PromptKind.MESSAGES, "chat")),
        (
            {"ids": pa.large_list(pa.int64())},
            {"token_ids_column": "ids"},
            (PromptKind.TOKEN_IDS, "ids"),
        ),
    ],
)
def test_prompt_column_detection(
    columns: dict[str, pa.DataType], flags: dict[str, str], expected: tuple[PromptKind, str]
) -> None:
    column = find_prompt_column(pa.schema(list(columns.items())), make_job(**flags).input)
    assert (column.kind, column.name) == expected


@pytest.mark.parametrize(
    ("columns", "flags", "message"),
    [
        ({"text": pa.string()}, {}, "no prompt column"),
        ({"prompt": pa.string(), "messages": MESSAGES}, {}, "several prompt columns"),
        (
            {"prompt": pa.string()},
            {"prompt_column": "q"},
            "prompt_column 'q' is not an input column",
        ),
        ({"prompt": pa.int64()}, {}, "must be string"),
        ({"messages": pa.list_(pa.string())}, {}, "must be list<struct"),
        ({"prompt_token_ids": pa.list_(pa.float32())}, {}, "must be list<int>"),
        ({"prompt": pa.string()}, {"prompt_column": "prompt", "messages_column": "m"}, "only one"),
    ],
)
def test_prompt_column_problems(
    columns: dict[str, pa.DataType], flags: dict[str, str], message: str
) -> None:
    with pytest.raises(JobError, match=message):
        find_prompt_column(pa.schema(list(columns.items())), make_job(**flags).input)


def test_id_column_must_exist() -> None:
    schema = pa.schema([("prompt", pa.string()), ("key", pa.string())])
    assert find_id_column(schema, make_job(id_column="key").input.id_column) == "key"
    with pytest.raises(JobError, match="id_column 'nope'"):
        find_id_column(schema, make_job(id_column="nope").input.id_column)


def test_output_column_name_collision_is_a_job_error() -> None:
    with pytest.raises(JobError, match="'completion' has the name of an output column"):
        output_schema(pa.schema([("prompt", pa.string()), ("completion", pa.string())]))


# -- rows to requests ---------------------------------------------------------------------------


def builder_for(
    tokenizer: PreTrainedTokenizerBase,
    columns: dict[str, pa.DataType],
    max_model_len: int = 64,
    **keys: Any,
) -> RequestBuilder:
    schema = pa.schema(list(columns.items()))
    job = make_job(**keys)
    return RequestBuilder(
        job.row_defaults(),
        find_prompt_column(schema, job.input),
        schema,
        tokenizer,
        max_model_len,
        500,
    )


def test_text_chat_and_token_id_rows(tokenizer: PreTrainedTokenizerBase) -> None:
    text = builder_for(tokenizer, {"prompt": pa.string()}).build(3, {"prompt": "def f(x):"})
    assert isinstance(text, Request)
    assert text.row_index == 3 and text.prompt_ids == tokenizer.encode("def f(x):")
    assert text.params == make_job().default_params(3)
    messages = [{"role": "user", "content": "hi", "name": None}]
    chat = builder_for(tokenizer, {"messages": MESSAGES}).build(0, {"messages": messages})
    assert isinstance(chat, Request)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert chat.prompt_ids == expected
    ids = builder_for(tokenizer, {"prompt_token_ids": pa.list_(pa.int32())})
    request = ids.build(1, {"prompt_token_ids": [0, 5, 499]})
    assert isinstance(request, Request) and request.prompt_ids == [0, 5, 499]


@pytest.mark.parametrize(
    ("columns", "values", "error"),
    [
        ({"prompt": pa.string()}, {"prompt": None}, "prompt is null"),
        ({"prompt": pa.string()}, {"prompt": ""}, "prompt is empty"),
        ({"prompt": pa.string()}, {"prompt": "word " * 80}, "tokens; the model's context is 64"),
        ({"messages": MESSAGES}, {"messages": []}, "messages is empty"),
        ({"messages": MESSAGES}, {"messages": None}, "messages is null"),
        (
            {"messages": MESSAGES},
            {"messages": [{"role": "user", "content": None}]},
            "malformed chat row: message 1",
        ),
        ({"messages": MESSAGES}, {"messages": [None]}, "malformed chat row: message 1"),
        (
            {"prompt_token_ids": pa.list_(pa.int64())},
            {"prompt_token_ids": [1, 500]},
            "token id 500 is outside",
        ),
        (
            {"prompt_token_ids": pa.list_(pa.int64())},
            {"prompt_token_ids": [-1]},
            "token id -1 is outside",
        ),
        (
            {"prompt_token_ids": pa.list_(pa.int64())},
            {"prompt_token_ids": [1, None]},
            "null token id",
        ),
        (
            {"prompt_token_ids": pa.list_(pa.int64())},
            {"prompt_token_ids": list(range(64))},
            "prompt is too long: 64 tokens",
        ),
    ],
)
def test_bad_prompts_are_error_strings(
    tokenizer: PreTrainedTokenizerBase,
    columns: dict[str, pa.DataType],
    values: dict[str, Any],
    error: str,
) -> None:
    result = builder_for(tokenizer, columns).build(0, values)
    assert isinstance(result, str) and error in result


def test_chat_template_failure_is_a_row_error(tokenizer: PreTrainedTokenizerBase) -> None:
    builder = builder_for(tokenizer, {"messages": MESSAGES})
    raising = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    raising.chat_template = "{{ raise_exception('roles must alternate') }}"
    builder.tokenizer = raising
    result = builder.build(0, {"messages": [{"role": "user", "content": "hi"}]})
    assert result == "chat template failed: roles must alternate"


def test_messages_need_a_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    with pytest.raises(JobError, match="no chat template"):
        builder_for(plain, {"messages": MESSAGES})


OVERRIDES = {
    "max_tokens": pa.int64(),
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
    "seed": pa.int64(),
    "stop": pa.list_(pa.string()),
    "stop_token_ids": pa.list_(pa.int64()),
}


def test_override_cells_and_null_cells(tokenizer: PreTrainedTokenizerBase) -> None:
    builder = builder_for(tokenizer, {"prompt": pa.string(), **OVERRIDES}, temperature=0.5, seed=9)
    cells = {name: None for name in OVERRIDES}
    request = builder.build(4, {"prompt": "x", **cells})
    assert isinstance(request, Request)
    assert request.params == SamplingParams(temperature=0.5, seed=row_seed(9, 4))
    values = {
        "max_tokens": 7.0,  # pandas writes int columns with nulls as float64
        "temperature": 1,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 11,
        "stop": ["\n"],
        "stop_token_ids": [2, 3],
    }
    request = builder.build(4, {"prompt": "x", **values})
    assert isinstance(request, Request)
    assert request.params == SamplingParams(7, 1.0, 0.9, 5, 11, ("\n",), (2, 3))


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("max_tokens", 2.5, "max_tokens must be an integer, got 2.5"),
        ("max_tokens", "ten", "max_tokens must be an integer, got 'ten'"),
        ("temperature", -1.0, "temperature must be a finite number >= 0"),
        ("temperature", float("nan"), "temperature must be a finite number >= 0"),
        ("temperature", "hot", "temperature must be a number"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_k", -2, "top_k must be an integer >= 0"),
        ("seed", True, "seed must be an integer"),
        ("stop", "\n", "stop must be a list of strings"),
        ("stop", [""], "stop must be a list of non-empty strings"),
        ("stop_token_ids", [1.5], "stop_token_ids must be a list of integers"),
        ("stop_token_ids", [-1], "stop_token_ids must be a list of non-negative integers"),
    ],
)
def test_bad_override_cells_are_error_strings(
    tokenizer: PreTrainedTokenizerBase, name: str, value: Any, error: str
) -> None:
    builder = builder_for(tokenizer, {"prompt": pa.string(), name: OVERRIDES[name]})
    result = builder.build(0, {"prompt": "x", name: value})
    assert isinstance(result, str) and result.startswith(error)


# -- output rows and parts ----------------------------------------------------------------------

INPUT_SCHEMA = pa.schema([("prompt", pa.string()), ("meta", pa.struct([("k", pa.int8())]))])


def input_slice(prompt: str) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{"prompt": prompt, "meta": {"k": 1}}], schema=INPUT_SCHEMA)


def finished(row_index: int, spec_hist: list[int] | None = None, rounds: int = 0) -> Request:
    request = Request(row_index=row_index, prompt_ids=[1, 2, 3], params=SamplingParams())
    request.output.token_ids = [5, 6, 7, 8, 9]
    request.output.finish_reason = "length"
    request.output.completion = "abc"
    request.output.spec_hist, request.output.spec_rounds = spec_hist, rounds
    return request


def test_a_part_of_only_error_rows_has_the_full_schema(tmp_path: Path) -> None:
    schema = output_schema(INPUT_SCHEMA)
    table = build_table(schema, [input_slice("p")], [error_row(7, "prompt is empty")])
    pq.write_table(table, tmp_path / "p.parquet")
    read = pq.read_table(tmp_path / "p.parquet")
    assert read.schema.equals(schema, check_metadata=True)
    row = read.to_pylist()[0]
    assert row["prompt"] == "p" and row["meta"] == {"k": 1}
    assert row["finish_reason"] == "error" and row["error"] == "prompt is empty"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (0, 0)
    assert row["completion"] is row["completion_token_ids"] is row["spec_rounds"] is None
    assert row["spec_accept_hist"] is row["acceptance_length"] is None
    assert build_table(schema, [], []).schema.equals(schema, check_metadata=True)


def test_finished_rows_with_and_without_a_draft() -> None:
    plain = finished_row(finished(1))
    assert (plain.completion_tokens, plain.prompt_tokens, plain.spec_rounds) == (5, 3, 0)
    assert plain.spec_accept_hist is None and plain.acceptance_length is None
    spec = finished_row(finished(2, [1, 0, 1, 0], rounds=2))
    assert spec.spec_accept_hist == [1, 0, 1, 0] and spec.acceptance_length == 2.0
    no_rounds = finished_row(finished(3, [0, 0, 0, 0], rounds=0))
    assert no_rounds.spec_rounds == 0 and no_rounds.acceptance_length is None


def test_row_ranges() -> None:
    assert row_ranges(np.array([], dtype=np.int64)) == []
    assert row_ranges(np.array([5, 1, 2, 3, 9, 10])) == [[1, 4], [5, 6], [9, 11]]


FINGERPRINT = {"input": [["a", 3]], "target": "t", "draft": None, "sampling": {"seed": 0}}


def commit_rows(out: OutputDir, indices: list[int]) -> Path:
    schema = output_schema(INPUT_SCHEMA)
    rows = [error_row(i, "x") for i in indices]
    return out.commit(build_table(schema, [input_slice("p") for _ in indices], rows))


def test_commit_writes_part_then_manifest_and_marks_rows_done(tmp_path: Path) -> None:
    out = OutputDir(tmp_path / "out")
    out.check(FINGERPRINT, overwrite=False)
    out.prepare(FINGERPRINT, overwrite=False)
    assert commit_rows(out, [0, 1, 4]).name == "part-000000.parquet"
    assert commit_rows(out, [2]).name == "part-000001.parquet"
    manifest = json.loads((tmp_path / "out/_progress/part-000000.json").read_text())
    started, written = manifest.pop("run_started"), manifest.pop("written")  # for `report`
    assert manifest == {"part": "part-000000.parquet", "rows": 3, "row_ranges": [[0, 2], [4, 5]]}
    assert out.part_times(tmp_path / "out" / "part-000000.parquet") == (started, written)
    assert abs(out.run_started - started) < 0.01 and started <= written <= time.time() + 0.01
    assert out.done_mask(6).tolist() == [True, True, True, False, True, False]
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name.endswith(".tmp")]


def test_recovery_after_a_kill(tmp_path: Path) -> None:
    out = OutputDir(tmp_path)
    out.prepare(FINGERPRINT, overwrite=False)
    commit_rows(out, [0, 1])
    second = commit_rows(out, [2, 3])
    commit_rows(out, [4])
    # Killed between a rename and its manifest, and during a part write:
    (tmp_path / "_progress" / f"{second.stem}.json").unlink()
    (tmp_path / ".part-000003.parquet.123.tmp").write_bytes(b"half a part")
    # A manifest whose part is gone (deleted by hand) marks nothing done:
    (tmp_path / "part-000002.parquet").unlink()
    out.prepare(FINGERPRINT, overwrite=False)
    assert (tmp_path / "_progress" / f"{second.stem}.json").exists()
    assert not (tmp_path / ".part-000003.parquet.123.tmp").exists()
    assert out.done_mask(5).tolist() == [True, True, True, True, False]
    assert commit_rows(out, [4]).name == "part-000002.parquet"


def test_a_different_job_is_refused_unless_overwrite(tmp_path: Path) -> None:
    out = OutputDir(tmp_path)
    out.prepare(FINGERPRINT, overwrite=False)
    commit_rows(out, [0])
    out.check(FINGERPRINT, overwrite=False)  # the same job resumes
    other = {**FINGERPRINT, "target": "other"}
    with pytest.raises(JobError, match=r"different job \(target differs\)"):
        out.check(other, overwrite=False)
    out.check(other, overwrite=True)
    (tmp_path / "stats.json").write_text("{}")
    out.prepare(other, overwrite=True)
    assert not out.all_parts() and not (tmp_path / "stats.json").exists()
    assert json.loads((tmp_path / "_progress/job.json").read_text()) == other


def test_parts_without_a_job_record_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"row_index": [0]}), tmp_path / "part-000000.parquet")
    with pytest.raises(JobError, match="no _progress/job.json"):
        OutputDir(tmp_path).check(FINGERPRINT, overwrite=False)


def test_output_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    with pytest.raises(JobError, match="not a directory"):
        OutputDir(tmp_path / "out").check(FINGERPRINT, overwrite=False)


def test_shards_share_an_output_directory(tmp_path: Path) -> None:
    first, second = OutputDir(tmp_path, (0, 2)), OutputDir(tmp_path, (1, 2))
    for out in (first, second):
        out.prepare(FINGERPRINT, overwrite=False)
    assert commit_rows(first, [0, 2]).name == "part-00000-of-00002-000000.parquet"
    assert commit_rows(second, [1]).name == "part-00001-of-00002-000000.parquet"
    (tmp_path / ".part-00001-of-00002-000001.parquet.9.tmp").write_text("")
    first.prepare(FINGERPRINT, overwrite=False)  # leaves the other shard's temp file alone
    assert (tmp_path / ".part-00001-of-00002-000001.parquet.9.tmp").exists()
    assert first.done_mask(4).tolist() == [True, True, True, False]
    assert first.stats_path == tmp_path / "_progress" / "stats-00000-of-00002.json"
    second.prepare(FINGERPRINT, overwrite=True)  # clears only its own rows
    assert first.done_mask(4).tolist() == [True, False, True, False]
    assert [p.name for p in first.own_parts()] == ["part-00000-of-00002-000000.parquet"]


# -- progress bar -------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_terminal() -> None:
    terminal = Terminal()
    bar = ProgressBar(total=10, enabled=True, stream=terminal)
    bar.update(done=5, tokens=100, tau=2.5, force=True)
    bar.log("batchrun: row 3: prompt is empty")
    bar.close()
    text = terminal.getvalue()
    assert "5/10 rows" in text and "tok/s" in text and "tau 2.50" in text
    assert "batchrun: row 3: prompt is empty\n" in text
    quiet = Terminal()
    ProgressBar(total=10, enabled=False, stream=quiet).update(5, 100, None, force=True)
    piped = io.StringIO()
    bar = ProgressBar(total=10, enabled=True, stream=piped)
    bar.update(5, 100, None, force=True)
    bar.log("a line")
    assert quiet.getvalue() == "" and piped.getvalue() == "a line\n"
