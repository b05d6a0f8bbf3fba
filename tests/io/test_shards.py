"""Shards of whole row groups: the assignment, what each shard reads, shards from the environment,
and the jobs/ launch scripts.

The end-to-end runs use real Parquet (several files, several row groups each) and the tiny model;
a shard's reads are observed through the files pyarrow opens, so a shard that read any row group
but its own would fail here.
"""

from __future__ import annotations

import io
import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.io.input.reader import InputFile, InputSource
from batchrun.io.input.shards import shard_rows
from batchrun.io.output.stats import STATS_COLUMNS, StatsAccumulator, Timing
from batchrun.runners.shard_env import apply_env_shard, shard_from_env
from tests.io.test_output_safety import assert_complete, committed_rows, read_output, write_job

REPO = Path(__file__).resolve().parents[2]
COMPARED = ("row_index", "completion", "completion_token_ids", "finish_reason", "number")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def source_of(files: list[list[int]]) -> InputSource:
    """An input of files with these row group sizes (no files on disk: footers are all it takes)."""
    out, first = [], 0
    for number, groups in enumerate(files):
        out.append(InputFile(Path(f"f{number}.parquet"), first, tuple(groups)))
        first += sum(groups)
    return InputSource(tuple(out), pa.schema([("prompt", pa.string())]))


# -- the assignment ------------------------------------------------------------------------------


def test_shards_are_contiguous_balanced_runs_of_whole_row_groups() -> None:
    rng = random.Random(7)
    for _ in range(200):
        files = [[rng.choice([0, 1, 5, 40, 100]) for _ in range(rng.randint(0, 6))] for _ in "abc"]
        source = source_of(files)
        total, sizes = source.total_rows, [rows for groups in files for rows in groups]
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # group boundaries
        for count in range(1, len(sizes) + 4):
            ranges = [shard_rows(source, (index, count)) for index in range(count)]
            covered = [row for rows in ranges for row in rows]
            assert covered == list(range(total))  # in order: every row once
            for rows in ranges:
                if rows:  # whole row groups only, and about total/count rows
                    assert rows.start in starts and rows.stop in starts
                    assert abs(len(rows) - total / count) <= max(sizes)
            groups = sum(1 for rows in sizes if rows)
            assert sum(1 for rows in ranges if rows) <= groups
        assert shard_rows(source, None) == range(total)


def test_a_row_group_goes_to_the_share_that_holds_its_middle_row() -> None:
    source = source_of([[10, 10], [10, 10]])
    assert [shard_rows(source, (i, 4)) for i in range(4)] == [
        range(0, 10),
        range(10, 20),
        range(20, 30),
        range(30, 40),
    ]
    assert [shard_rows(source, (i, 3)) for i in range(3)] == [
        range(0, 10),  # middle rows 4.5, 14.5, 24.5, 34.5; shares of 13.3 rows
        range(10, 30),
        range(30, 40),
    ]
    six = [shard_rows(source, (i, 6)) for i in range(6)]  # more shards than row groups
    assert [len(rows) for rows in six] == [10, 0, 10, 10, 0, 10]  # shares of 6.7 rows


# -- four shards against one unsharded run, and what each shard reads ----------------------------


class CountingFile(io.RawIOBase):
    """A file that records every (offset, length) read from it."""

    def __init__(self, path: Path, reads: list[tuple[int, int]]) -> None:
        self.file, self.reads = path.open("rb"), reads

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def readinto(self, buffer: Any) -> int:
        offset = self.file.tell()
        count = self.file.readinto(buffer)
        self.reads.append((offset, count))
        return count

    def close(self) -> None:
        self.file.close()
        super().close()


def group_spans(path: Path) -> list[tuple[int, int]]:
    """[start, stop) of each row group's column chunks in the file."""
    metadata = pq.read_metadata(path)
    spans = []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        columns = [group.column(c) for c in range(group.num_columns)]
        starts = [
            c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
            for c in columns
        ]
        stops = [start + c.total_compressed_size for start, c in zip(starts, columns, strict=True)]
        spans.append((min(starts), max(stops)))
    return spans


def write_input(directory: Path, sizes: list[int], row_group_size: int) -> list[Path]:
    directory.mkdir(parents=True)
    paths, first = [], 0
    for number, size in enumerate(sizes):
        prompts = [f"def shard_{first + i}(item):" for i in range(size)]
        table = pa.table(
            {
                "prompt": pa.array(prompts, pa.string()),
                "number": pa.array(range(first, first + size), pa.int64()),
            }
        )
        paths.append(directory / f"prompts-{number}.parquet")
        pq.write_table(table, paths[-1], row_group_size=row_group_size)
        first += size
    return paths


def test_four_shards_give_the_rows_of_one_run_each_reading_only_its_row_groups(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_input(tmp_path / "in", [23, 0, 17, 31], row_group_size=5)  # 14 row groups
    job = write_job(tmp_path, tiny_model, max_tokens=4, rows_per_part=4)
    reads: dict[tuple[Path, int], list[tuple[int, int]]] = {}  # (file, nth open) -> reads
    opened_groups: list[tuple[Path, int]] = []

    class Observed(pq.ParquetFile):
        """The input files that pyarrow opens as files (footers alone are parsed from bytes)."""

        def __init__(self, source: Any, **kwargs: Any) -> None:
            if isinstance(source, (str, Path)) and Path(source) in paths:
                key = (Path(source), len(reads))
                self.path = Path(source)
                source = CountingFile(Path(source), reads.setdefault(key, []))
            super().__init__(source, **kwargs)

        def iter_batches(self, *args: Any, row_groups: list[int], **kwargs: Any) -> Any:
            opened_groups.extend((self.path, g) for g in row_groups)
            return super().iter_batches(*args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", Observed)
    runner = CliRunner()

    def run(*flags: str) -> tuple[list[tuple[Path, int]], list[tuple[Path, int, int]]]:
        reads.clear()
        opened_groups.clear()
        result = runner.invoke(cli, ["run", str(job), *flags])
        assert result.exit_code == 0, result.output
        return list(opened_groups), [(k[0], *r) for k, rs in reads.items() for r in rs]

    all_groups = [(p, g) for p in paths for g in range(pq.read_metadata(p).num_row_groups)]
    all_groups = [(p, g) for p, g in all_groups if pq.read_metadata(p).row_group(g).num_rows]
    spans = {(p, g): span for p in paths for g, span in enumerate(group_spans(p))}
    read_by: list[list[tuple[Path, int]]] = []
    for index in range(4):
        groups, byte_reads = run("--shard", f"{index}/4")
        assert len(groups) == len(set(groups)) and groups, groups  # its own groups, each once
        read_by.append(groups)
        for path, offset, length in byte_reads:  # every byte read lies in one of its own groups
            assert any(
                (path, g) in groups and start <= offset and offset + length <= stop
                for (p, g), (start, stop) in spans.items()
                if p == path
            ), (index, path, offset, length)
        assert sum(length for *_, length in byte_reads) == sum(
            spans[group][1] - spans[group][0] for group in groups
        )
        if index < 3:
            assert not (tmp_path / "out" / "_SUCCESS").exists()
    assert sorted(group for groups in read_by for group in groups) == sorted(all_groups)
    # Balanced: 71 rows in groups of 5 (and the ends of files): 15 to 20 rows a shard.
    sizes = [len(set(rows)) for rows in _rows_by_shard(tmp_path / "out")]
    assert all(15 <= size <= 20 for size in sizes), sizes
    assert_complete(tmp_path / "out", 71)

    run("--output", str(tmp_path / "whole"))
    sharded, whole = read_output(tmp_path / "out"), read_output(tmp_path / "whole")
    for column in COMPARED:
        assert sharded.column(column).equals(whole.column(column)), column
    assert sharded.column("row_index").to_pylist() == sharded.column("number").to_pylist()
    assert len(committed_rows(tmp_path / "out")) == 71  # no duplicates


@pytest.mark.parametrize(
    "runs",
    [
        [["--shard", "0/2"], ["--shard", "1/2"], []],  # shards, then the whole job unsharded
        [[], ["--shard", "1/2"]],  # the whole job, then a shard over the finished directory
        [["--shard", "0/2"], []],  # one shard, then an unsharded run doing the rest
    ],
    ids=["shards-then-whole", "whole-then-shard", "shard-then-rest"],
)
def test_stats_json_covers_every_committed_row_after_sharded_and_unsharded_runs(
    tmp_path: Path, tiny_model: Path, runs: list[list[str]]
) -> None:
    write_input(tmp_path / "in", [5, 4], row_group_size=2)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    for flags in runs:
        result = CliRunner().invoke(cli, ["run", str(job), *flags])
        assert result.exit_code == 0, result.output
    assert_complete(out, 9)
    every_row = StatsAccumulator()
    for part in sorted(out.glob("part-*.parquet")):
        every_row.add(pq.read_table(part, columns=STATS_COLUMNS))
    expected = every_row.to_dict(
        info={}, block_size=None, timing=Timing(1.0, 0.0, 1.0), run_completion_tokens=0
    )
    stats = json.loads((out / "stats.json").read_text())
    for key in ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens"):
        assert stats[key] == expected[key], key
    assert stats["finish_reasons"] == expected["finish_reasons"]
    assert (stats["rows"], stats["input_rows"], stats["shard"]) == (9, 9, None)


def _rows_by_shard(out: Path) -> list[list[int]]:
    rows: list[list[int]] = []
    for index in range(4):
        parts = sorted(out.glob(f"part-{index:05d}-of-00004-*.parquet"))
        rows.append([r for p in parts for r in pq.read_table(p).column("row_index").to_pylist()])
    return rows


# -- shards from the environment -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "shard", "origin"),
    [
        ({}, None, None),
        (
            {
                "SLURM_ARRAY_TASK_ID": "7",
                "SLURM_ARRAY_TASK_MIN": "5",
                "SLURM_ARRAY_TASK_COUNT": "4",
            },
            (2, 4),
            "SLURM_ARRAY_TASK_ID=7, SLURM_ARRAY_TASK_MIN=5, SLURM_ARRAY_TASK_COUNT=4",
        ),
        ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1"}, (0, 1), None),
        (
            {
                "SLURM_ARRAY_TASK_ID": "14",
                "SLURM_ARRAY_TASK_MIN": "10",
                "SLURM_ARRAY_TASK_STEP": "2",
                "SLURM_ARRAY_TASK_COUNT": "3",
            },
            (2, 3),
            None,
        ),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, (3, 8), "RANK=3, WORLD_SIZE=8"),
        (  # torchrun inside each task of an array: every process of every task its own shard
            {
                "SLURM_ARRAY_TASK_ID": "2",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "RANK": "1",
                "WORLD_SIZE": "2",
            },
            (3, 6),
            None,
        ),
    ],
)
def test_shard_from_the_environment(
    environ: dict[str, str], shard: tuple[int, int] | None, origin: str | None
) -> None:
    found = shard_from_env(environ)
    assert (found.index, found.count) == shard if found else shard is None
    if origin is not None and found is not None:
        assert found.origin == origin


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "4"}, "not one of 4 tasks"),
        (
            {
                "SLURM_ARRAY_TASK_ID": "3",
                "SLURM_ARRAY_TASK_MIN": "5",
                "SLURM_ARRAY_TASK_COUNT": "4",
            },
            "not one of 4 tasks from 5",
        ),
        ({"SLURM_ARRAY_TASK_ID": "3"}, "SLURM_ARRAY_TASK_COUNT is not set"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
    ],
)
def test_a_bad_shard_environment_is_a_job_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(JobError, match=message):
        shard_from_env(environ)


def job_spec(**keys: Any) -> JobSpec:
    return JobSpec.from_keys(dict(input="in", output="out", target="model", **keys))


def test_torchrun_local_rank_picks_the_gpu_and_an_explicit_shard_wins() -> None:
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    log = io.StringIO()
    job = apply_env_shard(job_spec(), torchrun, log, cuda_devices=lambda: 4)
    assert (job.run.shard, job.engine.device) == ("5/8", "cuda:1")
    assert log.getvalue() == (
        "batchrun: shard 5/8 from RANK=5, WORLD_SIZE=8; device cuda:1 from LOCAL_RANK=1\n"
    )
    for device, devices, expected in (
        ("cuda", 4, "cuda:1"),
        ("cpu", 4, "cpu"),
        ("auto", 0, "auto"),
    ):
        job = apply_env_shard(job_spec(device=device), torchrun, io.StringIO(), lambda n=devices: n)
        assert job.engine.device == expected
    one_gpu = apply_env_shard(job_spec(), torchrun, io.StringIO(), cuda_devices=lambda: 1)
    assert one_gpu.engine.device == "auto"  # the launcher gave this process its own GPU
    with pytest.raises(JobError, match="LOCAL_RANK=5 but this process sees 4 CUDA devices"):
        apply_env_shard(job_spec(), {**torchrun, "LOCAL_RANK": "5"}, io.StringIO(), lambda: 4)
    log = io.StringIO()
    explicit = apply_env_shard(job_spec(shard="0/2"), torchrun, log, cuda_devices=lambda: 4)
    assert (explicit.run.shard, explicit.engine.device, log.getvalue()) == ("0/2", "auto", "")


def test_validate_takes_the_shard_from_slurm_unless_given(tmp_path: Path, tiny_model: Path) -> None:
    write_input(tmp_path / "in", [10, 10], row_group_size=5)
    job = write_job(tmp_path, tiny_model)
    slurm = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "2"}
    result = CliRunner().invoke(cli, ["validate", str(job)], env=slurm)
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "batchrun: shard 1/2 from SLURM_ARRAY_TASK_ID=4, SLURM_ARRAY_TASK_MIN=3, "
        "SLURM_ARRAY_TASK_COUNT=2\n"
    )
    assert "shard: 1/2, rows 10 to 19 (10 rows)" in result.stdout
    result = CliRunner().invoke(cli, ["validate", str(job), "--shard", "0/4"], env=slurm)
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert "shard: 0/4, rows 0 to 4 (5 rows)" in result.stdout


# -- the launch scripts of jobs/ -----------------------------------------------------------------


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """`batchrun` on PATH running this checkout, one thread per process."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "batchrun"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m batchrun.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    path = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_the_slurm_array_script_runs_as_written(tmp_path: Path, tiny_model: Path) -> None:
    write_input(tmp_path / "in", [12, 9], row_group_size=4)
    job = write_job(tmp_path, tiny_model)
    for task in ("3", "4"):  # --array=3-4
        env = script_env(
            tmp_path,
            SLURM_ARRAY_TASK_ID=task,
            SLURM_ARRAY_TASK_MIN="3",
            SLURM_ARRAY_TASK_COUNT="2",
        )
        done = subprocess.run(
            ["bash", "jobs/slurm_array.sbatch", str(job)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert f"batchrun: shard {int(task) - 3}/2 from SLURM_ARRAY_TASK_ID={task}" in done.stderr
    assert_complete(tmp_path / "out", 21)
    assert len(list((tmp_path / "out").glob("part-0000[01]-of-00002-*.parquet"))) >= 2


@pytest.mark.slow
def test_the_torchrun_script_runs_as_written(tmp_path: Path, tiny_model: Path) -> None:
    write_input(tmp_path / "in", [12, 9], row_group_size=4)
    job = write_job(tmp_path, tiny_model)
    done = subprocess.run(
        ["bash", "jobs/torchrun.sh", str(job)],
        cwd=REPO,
        env=script_env(tmp_path, NPROC_PER_NODE="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"batchrun: shard {rank}/2 from RANK={rank}, WORLD_SIZE=2" in done.stderr
    assert_complete(tmp_path / "out", 21)
