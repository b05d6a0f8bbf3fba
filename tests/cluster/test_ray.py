"""The Ray path against a local run of the same job on a tiny model: BatchrunProcessor on its own
and in a user's Ray Data pipeline, the driver's commits (duplicates dropped, resume, lost rows),
and `batchrun run --ray` on a local Ray cluster of 2 CPUs with 2 actors, one of them killed.

The tests that need Ray skip without it (the extra `batchrun[ray]`)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.io.output.stats import RunClock
from batchrun.runners.local import run_job
from batchrun.runners.opened_job import open_job
from batchrun.runners.ray import BatchrunProcessor
from batchrun.runners.ray.committer import commit_outputs
from batchrun.runners.ray.processor import processor_settings
from batchrun.runners.ray.run import CRASH_ONCE_ENV, preflight_info, run_job_ray

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [f"def step_{i}(state):" for i in range(18)] + ["", None, "import os", "x = 1", "y"]
ROWS = len(PROMPTS)
MAX_TOKENS = [3 if i % 4 == 1 else (-1 if i == 6 else None) for i in range(ROWS)]


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 files of several row groups: a prompt, a per-row max_tokens, a pass-through column."""
    directory = tmp_path_factory.mktemp("ray-input")
    table = pa.table(
        {
            "prompt": pa.array(PROMPTS, pa.string()),
            "max_tokens": pa.array(MAX_TOKENS, pa.int64()),
            "number": list(range(ROWS)),
        }
    )
    for number, start in enumerate((0, 8, 16)):
        pq.write_table(table.slice(start, 8), directory / f"{number}.parquet", row_group_size=3)
    return directory


def make_job(input_dir: Path, model: Path, output: Path, **keys: Any) -> JobSpec:
    settings = {"max_tokens": 6, "max_batch_size": 2, "rows_per_part": 5, "quiet": True, **keys}
    return JobSpec.from_keys(
        dict(input=str(input_dir), output=str(output), target=str(model), **settings)
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, input_dir: Path, tiny_model: Path) -> Path:
    """The output directory of a local run of the job."""
    out = tmp_path_factory.mktemp("ray-reference") / "out"
    run_job(make_job(input_dir, tiny_model, out))
    assert read_output(out).num_rows == ROWS
    return out


def assert_same_rows(got: pa.Table, reference: Path) -> None:
    expected = read_output(reference)
    got = got.sort_by("row_index")
    assert got.schema.equals(expected.schema, check_metadata=False)
    assert got.column("row_index").to_pylist() == list(range(ROWS))  # each row once
    assert got.to_pylist() == expected.to_pylist()


def nulls_as_none(column: Any) -> list[Any]:
    """A pandas column as a list, its missing values (None or NaN) as None."""
    return [
        None if missing else value for value, missing in zip(column, column.isna(), strict=True)
    ]


def input_table(input_dir: Path) -> pa.Table:
    table = pa.concat_tables(pq.read_table(p) for p in sorted(input_dir.glob("*.parquet")))
    return table.append_column("row_index", pa.array(range(ROWS), pa.int64()))


# -- BatchrunProcessor, without Ray ---------------------------------------------------------


def test_processor_gives_the_rows_of_a_local_run(
    input_dir: Path, tiny_model: Path, reference: Path
) -> None:
    settings = processor_settings(make_job(input_dir, tiny_model, Path("unused")))
    processor = BatchrunProcessor(**settings)
    table = input_table(input_dir)
    # Three batches through one engine, the last of them as a RecordBatch.
    parts = [processor(table.slice(0, 10)), processor(table.slice(10, 9))]
    parts.append(
        pa.Table.from_batches([processor(table.slice(19).combine_chunks().to_batches()[0])])
    )
    assert [p.num_rows for p in parts] == [10, 9, ROWS - 19]
    assert_same_rows(pa.concat_tables(parts), reference)
    empty = processor(table.slice(0, 0))
    assert empty.num_rows == 0 and empty.schema.equals(parts[0].schema)


def test_processor_takes_pandas_and_numbers_rows_without_a_row_index(
    input_dir: Path, tiny_model: Path, reference: Path
) -> None:
    processor = BatchrunProcessor(target=str(tiny_model), max_tokens=6, max_batch_size=3)
    frame = input_table(input_dir).drop_columns(["row_index"]).slice(4, 9).to_pandas()
    out = processor(frame)
    assert list(out["row_index"]) == list(range(9))  # positions in the batch
    assert list(out["number"]) == list(range(4, 13))
    expected = read_output(reference).slice(4, 9)
    assert nulls_as_none(out["completion"]) == expected.column("completion").to_pylist()
    ids = out["completion_token_ids"].tolist()
    assert ids == expected.column("completion_token_ids").to_pylist()
    assert list(out["finish_reason"]) == expected.column("finish_reason").to_pylist()
    # A dict of numpy arrays (Ray's "numpy" batch format) works too.
    numpy_batch = {name: np.asarray(frame[name]) for name in ("prompt", "number")}
    numpy_out = processor(numpy_batch)
    assert list(numpy_out["number"]) == list(range(4, 13)) and "completion" in numpy_out


def test_processor_refuses_file_settings_and_bad_batches(tiny_model: Path) -> None:
    with pytest.raises(JobError, match="'output' is not a BatchrunProcessor setting"):
        BatchrunProcessor(target=str(tiny_model), output="out")
    with pytest.raises(JobError, match="max_tokens"):
        BatchrunProcessor(target=str(tiny_model), max_tokens=0)
    processor = BatchrunProcessor(target=str(tiny_model), max_tokens=2)
    with pytest.raises(JobError, match="no prompt column"):
        processor(pa.table({"text": ["a"]}))
    with pytest.raises(JobError, match="'completion' has the name of an output column"):
        processor(pa.table({"prompt": ["a"], "completion": ["b"]}))
    with pytest.raises(JobError, match="row_index"):
        processor(pa.table({"prompt": ["a"], "row_index": pa.array([None], pa.int64())}))


# -- the driver's commits, without Ray -------------------------------------------------------


def processor_outputs(
    processor: BatchrunProcessor, input_dir: Path, done: np.ndarray, batch: int = 4
) -> Iterator[pa.Table]:
    """What the actors would return for the rows not done, batch by batch."""
    table = input_table(input_dir).filter(pa.array(~done))
    for start in range(0, table.num_rows, batch):
        yield processor(table.slice(start, batch))


def commit(job: JobSpec, outputs: Any) -> dict[str, Any]:
    opened = open_job(job)
    return commit_outputs(opened, preflight_info(job, opened.prompt), RunClock(), outputs)


def test_commits_drop_rows_returned_twice_and_resume_a_local_run(
    tmp_path: Path, input_dir: Path, tiny_model: Path, reference: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)  # a local run killed after its first three parts
    for part in sorted(out.glob("part-*.parquet"))[3:]:
        part.unlink()
        (out / "_progress" / f"{part.stem}.json").unlink()
    kept = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    committed = read_output(out).column("row_index").to_pylist()
    job = make_job(input_dir, tiny_model, out)
    processor = BatchrunProcessor(**processor_settings(job))
    seen_done: list[np.ndarray] = []
    again: list[pa.Table] = []

    def outputs(done: np.ndarray) -> Iterable[pa.Table]:
        seen_done.append(done)
        batches = list(processor_outputs(processor, input_dir, done))
        # A batch that Ray ran twice (an actor died after returning it) comes back again.
        again.extend([batches[0], batches[1].slice(1, 2)])
        return [batches[0], *batches, batches[1].slice(1, 2)]

    stats = commit(job, outputs)
    assert np.flatnonzero(seen_done[0]).tolist() == sorted(committed)
    assert_same_rows(read_output(out), reference)
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet") if p.name in kept} == kept
    assert (out / "_SUCCESS").exists()
    dropped = sum(table.num_rows for table in again)
    assert stats["rows"] == ROWS and stats["ray"]["duplicate_rows_dropped"] == dropped > 4
    assert json.loads((out / "stats.json").read_text())["rows"] == ROWS
    # Run again: nothing is left to do, and the outputs are not even asked for.
    commit(job, lambda done: pytest.fail("every row is committed"))


def test_rows_lost_on_the_way_are_no_success_and_the_next_run_does_them(
    tmp_path: Path, input_dir: Path, tiny_model: Path, reference: Path
) -> None:
    job = make_job(input_dir, tiny_model, tmp_path / "out")
    processor = BatchrunProcessor(**processor_settings(job))

    def lossy(done: np.ndarray) -> Iterable[pa.Table]:
        return [
            t.filter(pa.compute.not_equal(t.column("number"), 7))
            for t in processor_outputs(processor, input_dir, done)
        ]

    with pytest.raises(JobError, match="1 input rows got no output row"):
        commit(job, lossy)
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    redone: list[int] = []

    def rest(done: np.ndarray) -> Iterable[pa.Table]:
        redone.extend(np.flatnonzero(~done).tolist())
        return processor_outputs(processor, input_dir, done)

    commit(job, rest)
    assert redone == [7]
    assert_same_rows(read_output(tmp_path / "out"), reference)
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_ray_flag_without_ray_is_one_line(
    tmp_path: Path, input_dir: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    args = ["run", "--input", str(input_dir), "--output", str(tmp_path / "o")]
    args += ["--target", str(tiny_model)]
    result = CliRunner().invoke(cli, [*args, "--ray"])
    assert result.exit_code == 2
    assert result.stderr == "batchrun: error: --ray needs Ray: pip install 'batchrun[ray]'\n"
    result = CliRunner().invoke(cli, [*args, "--replicas", "2"])
    assert result.exit_code == 2 and "--replicas needs --ray" in result.stderr
    assert not (tmp_path / "o").exists()


# -- on a local Ray cluster ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def test_ray_run_with_a_killed_actor_gives_the_rows_of_a_local_run(
    ray_cluster: Any,
    tmp_path: Path,
    input_dir: Path,
    tiny_model: Path,
    reference: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marker = tmp_path / "crashed"
    monkeypatch.setenv(CRASH_ONCE_ENV, str(marker))  # the first actor to finish a row dies
    out = tmp_path / "out"
    stats = run_job_ray(make_job(input_dir, tiny_model, out), replicas=2)
    assert marker.exists()  # an actor did die mid-batch, and Ray ran its batch again
    assert_same_rows(read_output(out), reference)
    assert (out / "_SUCCESS").exists()
    assert stats["rows"] == ROWS and stats["ray"]["replicas"] == 2
    assert stats["error_rows"] == 3  # the empty and null prompts, the max_tokens of -1
    expected = json.loads((reference / "stats.json").read_text())
    for key in ("ok_rows", "prompt_tokens", "completion_tokens", "finish_reasons", "dtype"):
        assert stats[key] == expected[key], key


def test_ray_run_resumes_a_local_run_and_a_second_run_has_nothing_to_do(
    ray_cluster: Any, tmp_path: Path, input_dir: Path, tiny_model: Path, reference: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)  # a local run killed after its first two parts
    for part in sorted(out.glob("part-*.parquet"))[2:]:
        part.unlink()
        (out / "_progress" / f"{part.stem}.json").unlink()
    kept = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "{input_dir}"\noutput = "{out}"\ntarget = "{tiny_model}"\n'
        "max_tokens = 6\nmax_batch_size = 2\nrows_per_part = 5\nquiet = true\n"
    )
    result = CliRunner().invoke(cli, ["run", str(job), "--ray", "--replicas", "2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"batchrun: {ROWS} rows ")
    assert_same_rows(read_output(out), reference)
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet") if p.name in kept} == kept
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    assert CliRunner().invoke(cli, ["run", str(job), "--ray"]).exit_code == 0
    assert sorted(p.name for p in out.glob("part-*.parquet")) == parts


def test_processor_in_a_user_ray_data_pipeline(
    ray_cluster: Any, input_dir: Path, tiny_model: Path, reference: Path
) -> None:
    ray = ray_cluster
    settings = processor_settings(make_job(input_dir, tiny_model, Path("unused")))
    ds = ray.data.read_parquet(str(input_dir), override_num_blocks=3).map_batches(
        BatchrunProcessor,
        fn_constructor_kwargs=settings,
        batch_size=4,
        batch_format="pandas",
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=0.5,  # of the 2: the rest lists and reads the files
    )
    got = ds.to_pandas().sort_values("number")
    expected = read_output(reference)
    assert list(got["number"]) == list(range(ROWS))  # one output row per input row
    assert nulls_as_none(got["completion"]) == expected.column("completion").to_pylist()
    assert list(got["finish_reason"]) == expected.column("finish_reason").to_pylist()
    assert list(got["completion_tokens"]) == expected.column("completion_tokens").to_pylist()


def test_ray_refuses_a_shard(tmp_path: Path, input_dir: Path, tiny_model: Path) -> None:
    pytest.importorskip("ray")
    job = make_job(input_dir, tiny_model, tmp_path / "o").with_keys(shard="0/2")
    with pytest.raises(JobError, match="leave out shard"):
        run_job_ray(job)
