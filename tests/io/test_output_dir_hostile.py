"""A hostile output directory: whatever it holds, `stats`, `report`, `validate` and `run` end
normally or in one line (exit 2), never in a traceback; and batchrun never writes, replaces or
deletes through a symlink inside it (OUT itself may be one).

Every test starts from a copy of one finished job's output and runs that same job over it (the
same input file and target), so only what the test changed in the copy is new.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import Result

from batchrun.errors import JobError
from batchrun.io.output import claim
from batchrun.io.output.directory import OutputDir
from batchrun.io.parts import remove, write_text_atomically
from tests.io.test_output_safety import PROMPTS, invoke, write_job, write_prompts

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest

Job = tuple[Path, Path]  # a finished job: its job file and its output directory


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Job:
    directory = tmp_path_factory.mktemp("hostile")
    write_prompts(directory / "in", PROMPTS[:4])
    job = write_job(directory, tiny_model, max_batch_size=1)  # rows one by one, 2 a part: 2 parts
    result = invoke("run", str(job))
    assert result.exit_code == 0, result.output
    return job, directory / "out"


def copy_of(finished: Job, where: Path) -> Path:
    shutil.copytree(finished[1], where, symlinks=True)
    return where


def assert_clean(result: Result, what: object) -> None:
    """Exit 0 with nothing but warnings on stderr, or exit 2 with one error line."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        trace = "".join(traceback.format_exception(result.exception))
        pytest.fail(f"{what}: a traceback\n{trace}")
    lines = result.stderr.splitlines()
    if result.exit_code == 0:
        assert all(line.startswith("batchrun: warning: ") for line in lines), (what, lines)
    else:
        assert result.exit_code == 2, (what, result.output)
        assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), (what, lines)


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every entry under path (or path itself) and its bytes (None: a directory)."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(entry.relative_to(path)): entry.read_bytes() if entry.is_file() else None
        for entry in sorted(path.rglob("*"))
    }


# -- symlinks: refused in one line, their targets untouched --------------------------------------

# An entry in OUT made a symlink to something outside OUT, the command that would write,
# replace or delete it, and any flags.
SYMLINKS = [
    ("_progress", "run", []),  # would write manifests there and delete a "stale" one
    ("_claims", "run", []),  # would create a claim there and delete an unreadable one
    ("_progress/damaged", "run", []),  # would move a damaged part there
    ("_progress/job.json", "run", []),
    ("_progress/part-000000.json", "run", []),  # a manifest
    ("_progress/stats-00000-of-00002.json", "run", ["--shard", "0/2"]),
    ("_claims/other.claim", "run", []),  # an unreadable claim past its grace
    ("part-000000.parquet", "run", ["--overwrite"]),
    ("part-000001.parquet", "run", []),  # damaged, so it would be moved aside
    ("stats.json", "run", []),
    ("_SUCCESS", "run", []),
    (".part-000002.parquet.123.tmp", "run", []),  # a temp a kill left, deleted at start-up
    ("_progress/part-000000.json", "validate", []),  # refused by the start-up checks
    ("report.html", "report", []),
]


@pytest.mark.parametrize(("entry", "command", "flags"), SYMLINKS)
def test_batchrun_never_writes_or_deletes_through_a_symlink(
    tmp_path: Path, finished: Job, entry: str, command: str, flags: list[str]
) -> None:
    job, _ = finished
    out = copy_of(finished, tmp_path / "out")
    (out / "part-000001.parquet").write_bytes(b"PAR1 damaged")  # a damaged part to move aside
    (out / "_SUCCESS").unlink()  # and its rows to redo
    outside = tmp_path / "elsewhere"  # what the link points at: what it holds, or a decoy
    link = out / entry
    if entry in ("_progress", "_claims", "_progress/damaged"):
        link.mkdir(exist_ok=True)
        shutil.move(link, outside)
        (outside / "part-000009.json").write_text('{"part": "part-000009.parquet"}')  # stale
        (outside / "other.claim").write_text("not a claim")
        os.utime(outside / "other.claim", (0, 0))  # past the grace of a claim being written
    else:
        outside.write_bytes(link.read_bytes() if link.exists() else b"not a claim")
        link.unlink(missing_ok=True)
        os.utime(outside, (0, 0))
    link.symlink_to(outside, target_is_directory=outside.is_dir())
    before = snapshot(outside)
    if command == "report":
        result = invoke(command, str(out))
    else:
        result = invoke(command, str(job), "--output", str(out), *flags)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and f"{str(link)!r} is a symlink" in lines[0], result.stderr
    assert snapshot(outside) == before  # byte for byte, and nothing created there
    assert link.is_symlink()


def test_the_output_directory_itself_may_be_a_symlink(tmp_path: Path, finished: Job) -> None:
    job, _ = finished
    real = copy_of(finished, tmp_path / "real")
    (real / "part-000001.parquet").unlink()  # rows to redo
    link = tmp_path / "out"
    link.symlink_to(real, target_is_directory=True)
    for args in (["run", str(job), "--output", str(link)], ["stats", str(link)]):
        result = invoke(*args)
        assert result.exit_code == 0 and not result.stderr, result.output
    assert "rows: 4 (4 ok, 0 errors)" in result.stdout  # its rows redone, in the real directory
    assert (real / "_SUCCESS").exists() and (real / "part-000001.parquet").exists()


def test_writes_and_deletes_refuse_a_symlink_that_appears_after_start_up(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    out = OutputDir(tmp_path / "out")
    out.prepare({"job": 1}, overwrite=False)
    link = tmp_path / "out" / "stats.json"
    link.symlink_to(target)
    for act in (lambda: write_text_atomically(link, "x"), lambda: remove(link)):
        with pytest.raises(JobError, match="is a symlink"):
            act()
    shutil.rmtree(out.progress)
    out.progress.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(JobError, match="_progress' is a symlink"):
        out.commit(pa.table({"row_index": pa.array([0], pa.int64())}))
    assert target.read_text() == "keep" and link.is_symlink()
    assert not list(tmp_path.glob("part-*")) and not list(tmp_path.glob(".*tmp"))


# -- the fuzz -------------------------------------------------------------------------------------

JSON_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    7,
    2**70,
    1.5,
    -0.5,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "part-000000.parquet",
    [],
    [1, 2],
    [0, 1, 2],
    [[0, 1]],
    [[-3, 2]],
    [[1, 0]],
    [["a", "b"]],
    [[0, 2**70]],
    {},
    {"a": 1},
    {"part": "x"},
]
FIELDS = {  # the fields of each kind of JSON file batchrun writes, with some it does not
    "manifest": ["part", "rows", "row_ranges", "run_started", "written", "extra"],
    "job": ["version", "input", "prompt", "dtype", "target", "draft", "sampling"],
    "stats": [
        "rows",
        "wall_seconds",
        "load_seconds",
        "generation_seconds",
        "input_rows",
        "shard",
        "draft",
        "target",
        "block_size",
    ],
    "claim": ["host", "boot_id", "pid", "start_time", "since", "shard", "token", "rows", "extra"],
}
PART_NAMES = [
    "part-000000.parquet",
    "part-000001.parquet",
    "part-000007.parquet",
    "part-00001-of-00002-000000.parquet",
    "part-.parquet",
]


def clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def json_file(rng: random.Random, path: Path, kind: str) -> None:
    """A JSON file of this kind with one field of a random type, or any JSON value, or junk."""
    original = path.read_text() if path.is_file() else "{}"
    clear(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    how = rng.randrange(6)
    if how == 0:
        path.write_text(json.dumps(rng.choice(JSON_VALUES)))
    elif how == 1:
        path.write_bytes(rng.choice([b"", b"\xff\xfe{", b"{", b"[" * 5, b"\x00"]))
    elif how == 2:
        path.mkdir()
    else:
        data = json.loads(original) if original.startswith("{") else {}
        data[rng.choice(FIELDS[kind])] = rng.choice(JSON_VALUES)
        if rng.random() < 0.3:
            data.pop(rng.choice(FIELDS[kind]), None)
        path.write_text(json.dumps(data))


def part_file(rng: random.Random, out: Path) -> None:
    """A part file batchrun did not write, or one it did, damaged or forged."""
    path = out / rng.choice(PART_NAMES)
    real = (
        pq.read_table(out / "part-000000.parquet")
        if (out / "part-000000.parquet").is_file()
        else None
    )
    clear(path)
    how = rng.randrange(8)
    if how == 0 or real is None:
        pq.write_table(pa.table({"x": [1, 2]}), path)
    elif how == 1:
        pq.write_table(real.replace_schema_metadata(None), path)  # batchrun's columns, no key
    elif how == 2:
        pq.write_table(real.replace_schema_metadata({b"batchrun.job": b"0" * 32}), path)
    elif how == 3:  # this job's key, other columns
        forged = pa.table({"row_index": ["a"], "y": [1.5]})
        pq.write_table(forged.replace_schema_metadata(real.schema.metadata), path)
    elif how == 4:
        path.write_bytes(rng.randbytes(rng.randrange(0, 64)))
    elif how == 5:
        path.write_bytes(b"\xff" * 8 + b"PAR1")  # a footer length past the file
    elif how == 6:
        path.mkdir()
    else:
        path.symlink_to(out.parent / "nowhere.parquet")  # dangling


def shape(rng: random.Random, out: Path) -> None:
    """A file where batchrun keeps a directory, or a directory where it keeps a file."""
    path = out / rng.choice(
        [
            "_progress",
            "_claims",
            "_progress/damaged",
            "_SUCCESS",
            "stats.json",
            "report.html",
            "_progress/job.json",
            "_progress/part-000000.json",
        ]
    )
    was_dir = path.is_dir()
    clear(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if was_dir or path.name == "damaged":
        path.write_bytes(b"")
    else:
        path.mkdir()


def claim_file(rng: random.Random, out: Path) -> None:
    path = out / "_claims" / f"c{rng.randrange(100)}.claim"
    if not (out / "_claims").is_dir():
        return
    info = claim.ClaimInfo.for_this_process(None)
    path.write_text(info.to_json())
    json_file(rng, path, "claim")
    if path.exists():
        os.utime(path, (0, 0))  # past every grace: fresh unreadable ones make run retry


def manifest_file(rng: random.Random, out: Path) -> None:
    json_file(rng, out / "_progress" / f"part-00000{rng.randrange(3)}.json", "manifest")


MUTATIONS: list[Callable[[random.Random, Path], None]] = [
    part_file,
    manifest_file,
    lambda rng, out: json_file(rng, out / "_progress" / "job.json", "job"),
    lambda rng, out: json_file(rng, out / "stats.json", "stats"),
    lambda rng, out: json_file(rng, out / "_progress" / "stats-00000-of-00002.json", "stats"),
    shape,
    claim_file,
]


def test_fuzz_the_output_directory(
    tmp_path: Path, finished: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _ = finished
    monkeypatch.setattr(claim, "ATTEMPTS", 1)  # a live-looking claim refuses at once
    rng = random.Random(20240617)
    started = time.monotonic()
    for case in range(100):
        out = copy_of(finished, tmp_path / f"case-{case}")
        for _ in range(rng.randint(1, 3)):
            # An earlier mutation can make this one moot (a directory it writes in is a file).
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, FileExistsError):
                rng.choice(MUTATIONS)(rng, out)
        commands = [["stats", str(out)], ["validate", str(job), "--output", str(out)]]
        if case % 5 == 0:
            commands.append(["report", str(out), "--out", str(tmp_path / "report.html")])
        if case % 5 == 1:
            commands.append(["report", str(out)])
        if case % 20 == 2:
            commands.append(["run", str(job), "--output", str(out)])
        for args in commands:
            assert_clean(invoke(*args), (case, args[0], sorted(snapshot(out))))
    assert time.monotonic() - started < 60
