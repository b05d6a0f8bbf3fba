"""The output directory never loses, duplicates or mixes rows.

An exclusive claim per output directory (or shard) that survives kill -9 of its holder, a job
fingerprint that refuses to resume a different job, no output read back as input, failures after
start-up in one line with nothing lost, damaged parts redone, and zero-row jobs that still finish.
Where the claim matters the runs are real `python -m batchrun.cli run` processes.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from batchrun.cli import cli
from batchrun.errors import JobError
from batchrun.io.input.listing import resolve_input_paths
from batchrun.io.output import claim
from batchrun.io.output.claim_space import DirectoryClaims
from batchrun.io.output.columns import build_table, error_row, output_schema
from batchrun.io.output.directory import OutputDir
from batchrun.tools.tiny_draft import make_tiny_draft

REPO = Path(__file__).resolve().parents[2]
# Tiny models run fastest on one thread; more only contend with other processes for the cores.
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PROMPTS = [f"def handler_{i}(event):" for i in range(8)]
HOST = socket.gethostname()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


# -- helpers (also used by test_stress.py) -------------------------------------------------------


def write_prompts(
    directory: Path,
    prompts: Sequence[str],
    name: str = "prompts.parquet",
    row_group_size: int | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "prompt": pa.array(prompts, pa.string()),
            "text": pa.array([p.upper() for p in prompts], pa.string()),
            "number": pa.array(range(len(prompts)), pa.int64()),
        }
    )
    pq.write_table(table, directory / name, row_group_size=row_group_size)
    return directory / name


def write_job(tmp_path: Path, model: Path, **keys: Any) -> Path:
    settings = {
        "input": "in",
        "output": "out",
        "target": str(model),
        "quiet": True,
        "max_tokens": 3,
        "rows_per_part": 2,
        "max_batch_size": 4,
        **keys,
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    job = tmp_path / "job.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def start(job: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", "run", str(job), *flags],
        cwd=REPO,
        env=ONE_THREAD_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_process(job: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchrun.cli", "run", str(job), *flags],
        cwd=REPO,
        env=ONE_THREAD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(returncode: int, stderr: str, message: str) -> None:
    assert returncode == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), stderr
    assert message in lines[0], lines[0]


def committed_rows(out: Path) -> list[int]:
    """Every row_index in the committed parts, duplicates included."""
    rows: list[int] = []
    for part in sorted(out.glob("part-*.parquet")):
        rows += pq.read_table(part, columns=["row_index"]).column("row_index").to_pylist()
    return rows


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")


def assert_complete(out: Path, rows: int) -> None:
    """_SUCCESS, and every input row exactly once."""
    assert (out / "_SUCCESS").exists()
    assert sorted(committed_rows(out)) == list(range(rows))


def claim_files(out: Path) -> list[Path]:
    return sorted((out / claim.CLAIMS_DIR).glob("*" + claim.CLAIM_SUFFIX))


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def start_stopped_holder(
    job: Path, out: Path, *flags: str, ready: Callable[[], bool] | None = None
) -> subprocess.Popen[str]:
    """A run that holds its claim, frozen with SIGSTOP (alive, so its claim is live) once its
    claim file appears, or once ready() holds."""
    before = set(claim_files(out))
    process = start(job, *flags)
    wait_for(ready or (lambda: bool(set(claim_files(out)) - before)), process)
    os.kill(process.pid, signal.SIGSTOP)
    return process


def kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.communicate()


def write_claim(out: Path, **fields: Any) -> Path:
    """A claim file as another run would have written it; fields override this process's."""
    info = claim.ClaimInfo.for_this_process(shard=None)
    values = {**dataclasses.asdict(info), "token": "someone-else", **fields}
    space = claim_space(out)
    space.prepare()
    name = claim.claim_name(values["token"])
    assert space.create(name, claim.ClaimInfo(**values).to_json())
    return space.directory / name


def claim_space(out: Path) -> DirectoryClaims:
    return DirectoryClaims(out / claim.CLAIMS_DIR)


def acquire(out: Path) -> claim.Claim:
    return claim.acquire(claim_space(out), None, None, shown=str(out))


def age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def snapshot(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("part-*.parquet"))}


# -- 1. the claim --------------------------------------------------------------------------------


def test_a_second_run_is_refused_and_a_killed_holder_is_taken_over(
    tmp_path: Path, tiny_model: Path
) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    holder = start_stopped_holder(job, out)
    try:
        for flags in ([], ["--shard", "1/2"]):  # the whole directory, or a shard of it
            done = run_process(job, *flags)
            message = f"is being written by pid {holder.pid} on host {HOST} since"
            assert_one_line_error(done.returncode, done.stderr, message)
        assert not list(out.glob("part-*.parquet"))
    finally:
        kill(holder)
    done = run_process(job)  # the killed holder's claim is stale: taken over
    assert done.returncode == 0, done.stderr
    assert_complete(out, len(PROMPTS))
    assert not claim_files(out)  # released on exit


def test_shards_with_different_rows_run_side_by_side(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS, row_group_size=2)  # 4 row groups: 0-1, 2-3, ...
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    holder = start_stopped_holder(job, out, "--shard", "0/2")  # rows 0-3
    try:
        for shard in ("1/2", "3/4"):  # rows 4-7, rows 6-7
            done = run_process(job, "--shard", shard)
            assert done.returncode == 0, done.stderr
        holds = f"is being written by pid {holder.pid} on host {HOST} since"
        for flags, own in (([], ""), (["--shard", "0/2"], " (shard 0/2, rows 0-3)")):
            done = run_process(job, *flags)
            assert_one_line_error(done.returncode, done.stderr, f"{own} {holds}")
        done = run_process(job, "--shard", "1/4")  # rows 2-3, which shard 0/2 holds too
        message = f"(shard 1/4, rows 2-3) {holds}"
        assert_one_line_error(done.returncode, done.stderr, message)
        assert "(shard 0/2, rows 0-3)" in done.stderr
    finally:
        kill(holder)
    assert not (out / "_SUCCESS").exists()
    done = run_process(job, "--shard", "0/2")
    assert done.returncode == 0, done.stderr
    assert_complete(out, len(PROMPTS))


def test_a_run_that_lost_its_claim_commits_nothing_more(tmp_path: Path, tiny_model: Path) -> None:
    prompts = [f"class Job{i}:" for i in range(40)]
    write_prompts(tmp_path / "in", prompts)
    job, out = write_job(tmp_path, tiny_model, max_tokens=8), tmp_path / "out"
    started = lambda: (out / "_progress" / "job.json").exists()  # noqa: E731 (claimed, prepared)
    holder = start_stopped_holder(job, out, ready=started)
    try:
        committed = snapshot(out)
        # Another host judged the frozen run dead and took over.
        for path in claim_files(out):
            path.unlink()
        foreign = write_claim(out, host="node-b", boot_id="b", pid=4242, start_time="1")
        os.kill(holder.pid, signal.SIGCONT)
        _, stderr = holder.communicate(timeout=300)
    finally:
        kill(holder)
    assert_one_line_error(holder.returncode, stderr, "is no longer claimed by this run")
    assert "pid 4242 on host node-b" in stderr
    assert snapshot(out) == committed and len(committed) < len(prompts) // 2
    done = run_process(job)  # node-b's heartbeat is fresh: it is live
    message = "is being written by pid 4242 on host node-b"
    assert_one_line_error(done.returncode, done.stderr, message)
    age(foreign, claim.STALE_AFTER_SECONDS + 60)  # node-b stopped beating
    done = run_process(job)
    assert done.returncode == 0, done.stderr
    assert_complete(out, len(prompts))


def test_a_claim_whose_pid_names_another_process_is_taken_over(
    tmp_path: Path, tiny_model: Path
) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    live = write_claim(out)  # this test process: alive, its own start time
    done = run_process(job)
    message = f"is being written by pid {os.getpid()} on host {HOST}"
    assert_one_line_error(done.returncode, done.stderr, message)
    live.unlink()
    write_claim(out, start_time="1")  # the pid was reused: another process started at another time
    done = run_process(job)
    assert done.returncode == 0, done.stderr
    assert_complete(out, len(PROMPTS))


def contend(out: Path, contenders: int) -> tuple[list[claim.Claim], list[str]]:
    """Threads that all try to claim `out` at the same moment."""
    barrier = threading.Barrier(contenders)
    held: list[claim.Claim] = []
    refused: list[str] = []

    def attempt() -> None:
        barrier.wait()
        try:
            held.append(acquire(out))
        except JobError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=attempt) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return held, refused


def test_contenders_for_a_stale_claim_elect_exactly_one(tmp_path: Path) -> None:
    for trial in range(5):
        out = tmp_path / f"out-{trial}"
        stale = write_claim(out, host="node-c", boot_id="c", pid=7)
        age(stale, claim.STALE_AFTER_SECONDS + 1)
        held, refused = contend(out, 6)
        assert len(held) == 1 and len(refused) == 5, refused
        assert [p.name for p in claim_files(out)] == [held[0].name]  # the stale claim is gone
        held[0].release()
        assert not claim_files(out)


@pytest.mark.parametrize(
    "content",  # the file's text, or fields of another host's claim, of the wrong type
    ["[1, 2]", "null", '"x"', "3", "\ufeff{", {"since": "x"}, {"pid": "7"}, {"rows": [0, True]}],
)
def test_a_claim_file_that_is_no_claim_counts_as_unreadable(
    tmp_path: Path, content: str | dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As one still being written: live while fresh, deleted once past the grace."""
    out = tmp_path / "out"
    other = write_claim(out, host="node-b", **(content if isinstance(content, dict) else {}))
    if isinstance(content, str):
        other.write_text(content)
    monkeypatch.setattr(claim, "ATTEMPTS", 1)  # no retries: a fresh conflict is final at once
    with pytest.raises(JobError, match="a run whose claim is being written"):
        acquire(out)
    age(other, claim.UNWRITTEN_GRACE_SECONDS + 1)
    acquire(out).release()
    assert not claim_files(out)


def test_which_shards_share_rows() -> None:
    overlap = claim.rows_overlap
    # Different shards conflict iff their row ranges intersect, whatever their N.
    assert not overlap((0, 2), (0, 50), (1, 2), (50, 100))
    assert not overlap((0, 2), (0, 50), (3, 4), (75, 100))
    assert overlap((0, 2), (0, 50), (1, 4), (25, 50)) and overlap((1, 3), (33, 66), (0, 2), (0, 50))
    assert not overlap((0, 2), (0, 50), (5, 8), (50, 50))  # a shard without rows
    # The same shard always (same part names), an unsharded run with every run (it owns every
    # part), and a claim whose rows are unknown (an older batchrun's) with every run.
    assert overlap((1, 2), (50, 100), (1, 2), (50, 100)) and overlap((1, 4), (0, 0), (1, 4), (0, 0))
    assert overlap(None, (0, 100), None, (0, 100)) and overlap(None, (0, 100), (7, 8), (0, 0))
    assert overlap((0, 2), None, (1, 2), (50, 100))
    older = claim.ClaimInfo.from_json(
        '{"host": "h", "boot_id": "b", "pid": 1, "start_time": "1", '
        '"since": 0, "shard": [0, 2], "token": "t"}'
    )
    assert older.rows is None and older.overlaps(claim.ClaimInfo.for_this_process((1, 2), (5, 9)))


# -- 2. the job fingerprint ----------------------------------------------------------------------


def rewrite_input(tmp_path: Path) -> None:
    time.sleep(0.01)  # a new mtime even on coarse clocks
    write_prompts(tmp_path / "in", [p.replace("handler", "worker") for p in PROMPTS])


def touch_target(tmp_path: Path, model: Path) -> None:
    os.utime(model / "config.json")


@pytest.mark.parametrize(
    ("change", "flags", "message"),
    [
        (rewrite_input, [], "(input["),
        (None, ["--prompt-column", "text"], "(prompt.column differs)"),
        (None, ["--dtype", "bfloat16"], "(dtype differs)"),
        (None, ["--kv-cache-dtype", "fp8"], "(kv_cache_dtype differs)"),
        (None, ["--temperature", "0.5"], "(sampling.temperature differs)"),
        (None, ["--draft", "DRAFT"], "(draft differs)"),
    ],
)
def test_resume_refuses_a_different_job(
    tmp_path: Path,
    tiny_model: Path,
    change: Callable[[Path], None] | None,
    flags: list[str],
    message: str,
) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    assert invoke("run", str(job)).exit_code == 0
    if change is not None:
        change(tmp_path)
    if "DRAFT" in flags:
        draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4)
        flags = [str(draft) if flag == "DRAFT" else flag for flag in flags]
    refused = invoke("run", str(job), *flags)
    assert refused.exit_code == 2, refused.output
    lines = refused.stderr.splitlines()
    assert len(lines) == 1 and "holds parts of a different job" in lines[0] and message in lines[0]
    assert invoke("run", str(job), *flags, "--overwrite").exit_code == 0
    assert_complete(out, len(PROMPTS))


def test_model_files_are_part_of_the_job(tmp_path: Path, make_model: Any) -> None:
    model = make_model(seed=11)  # its own copy: this test touches its files
    write_prompts(tmp_path / "in", PROMPTS)
    job = write_job(tmp_path, model)
    assert invoke("run", str(job)).exit_code == 0
    time.sleep(0.01)
    os.utime(model / "model.safetensors")
    refused = invoke("run", str(job))
    assert refused.exit_code == 2 and "(target['model.safetensors'] differs)" in refused.stderr


def test_an_output_directory_that_is_also_the_target_is_the_same_job_again(
    tmp_path: Path, tiny_model: Path
) -> None:
    model = tmp_path / "model"  # its own copy: the job writes into it
    shutil.copytree(tiny_model, model)
    write_prompts(tmp_path / "in", PROMPTS)
    job = write_job(tmp_path, model, output="model")
    assert invoke("run", str(job)).exit_code == 0
    assert invoke("report", str(model)).exit_code == 0  # report.html, beside stats.json
    parts = snapshot(model)
    again = invoke("run", str(job))
    assert again.exit_code == 0, again.output
    assert snapshot(model) == parts  # every row found done
    assert_complete(model, len(PROMPTS))
    refused = invoke("run", str(job), "--temperature", "0.5")  # another job is still told apart
    assert refused.exit_code == 2 and "(sampling.temperature differs)" in refused.stderr


def test_resume_accepts_what_does_not_change_outputs(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    assert invoke("run", str(job)).exit_code == 0
    parts = snapshot(out)
    for flags in (
        ["--id-column", "number"],
        ["--dtype", "float32"],  # what auto resolves to on a CPU
        ["--prompt-column", "prompt"],  # the column auto-detection found
        ["--max-batch-size", "2", "--rows-per-part", "5"],
        ["--schedule-window", "0"],  # admission order only
    ):
        result = invoke("run", str(job), *flags)
        assert result.exit_code == 0, result.output
    assert snapshot(out) == parts


def test_shards_never_mix_the_rows_of_two_jobs(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS, row_group_size=4)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    for shard in ("0/2", "1/2"):
        assert invoke("run", str(job), "--shard", shard).exit_code == 0
    other = ["--temperature", "0.8"]  # another job
    assert invoke("run", str(job), "--shard", "0/2", *other, "--overwrite").exit_code == 0
    assert not (out / "_SUCCESS").exists()  # shard 1's rows are still the first job's
    refused = invoke("run", str(job), "--shard", "1/2", *other)
    assert refused.exit_code == 2
    assert "(part-00001-of-00002-000000.parquet was written by another job)" in refused.stderr
    assert invoke("run", str(job), "--shard", "1/2", *other, "--overwrite").exit_code == 0
    assert_complete(out, len(PROMPTS))


# -- 3. the demo job and --no-overwrite ----------------------------------------------------------


def test_the_demo_job_can_run_twice(tmp_path: Path) -> None:
    demo = REPO / "jobs" / "demo.toml"
    assert "overwrite" not in tomllib.loads(demo.read_text())
    out = tmp_path / "demo"
    args = ["run", str(demo), "--output", str(out), "--max-tokens", "2", "--quiet"]
    assert invoke(*args).exit_code == 0
    parts = snapshot(out)
    again = invoke(*args)
    assert again.exit_code == 0, again.output
    assert snapshot(out) == parts  # every row was found done; nothing was rewritten
    assert_complete(out, 48)


def test_no_overwrite_turns_off_a_job_files_overwrite(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model, overwrite=True), tmp_path / "out"
    assert invoke("run", str(job)).exit_code == 0
    parts = snapshot(out)
    resumed = invoke("run", str(job), "--no-overwrite")
    assert resumed.exit_code == 0, resumed.output
    assert snapshot(out) == parts
    assert invoke("run", str(job)).exit_code == 0
    assert snapshot(out) != parts  # the job file's overwrite = true replaced them
    assert_complete(out, len(PROMPTS))


# -- 4. an output directory inside the input directory -------------------------------------------


def test_an_output_inside_the_input_is_never_read_back(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "data", PROMPTS)
    job = write_job(tmp_path, tiny_model, input="data", output="data/out")
    for _ in range(2):
        result = invoke("run", str(job))
        assert result.exit_code == 0, result.output
    assert_complete(tmp_path / "data" / "out", len(PROMPTS))
    # Another job reading the same directory sees the prompts only.
    other = invoke("run", str(job), "--output", str(tmp_path / "other"))
    assert other.exit_code == 0, other.output
    assert_complete(tmp_path / "other", len(PROMPTS))


def test_input_resolution_skips_the_output_and_batchrun_outputs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = write_prompts(data, PROMPTS[:2], "a.parquet")
    deeper = write_prompts(data / "more", PROMPTS[:2], "b.parquet")
    old_run = data / "old-run"  # a finished job's output directory inside the input
    (old_run / "_progress").mkdir(parents=True)
    part = write_prompts(old_run, PROMPTS[:1], "part-000000.parquet")
    out = data / "out"
    write_prompts(out, PROMPTS[:1], "part-000000.parquet")
    assert resolve_input_paths(str(data), exclude=out) == [first, deeper]
    assert resolve_input_paths(str(data / "**" / "*.parquet"), exclude=out) == [
        first,
        deeper,
        part,
    ]
    assert resolve_input_paths(str(old_run)) == [part]  # named itself, it is input
    with pytest.raises(JobError, match="inside the output directory"):
        resolve_input_paths(str(out / "part-000000.parquet"), exclude=out)


# -- 5. failures after start-up: one line, exit 2, nothing lost ----------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_failed_part_write_stops_in_one_line_and_loses_nothing(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    from batchrun.io import store  # the local store writes parts

    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    real_write = store.write_part
    calls: list[Path] = []

    def write_part(path: Path, table: pa.Table) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(code, os.strerror(code), str(path))
        real_write(path, table)

    monkeypatch.setattr(store, "write_part", write_part)
    failed = invoke("run", str(job))
    assert failed.exit_code == 2, failed.output
    lines = failed.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), failed.stderr
    assert os.strerror(code) in lines[0] and "redone" in lines[0]
    assert 0 < len(committed_rows(out)) < len(PROMPTS)  # the first part only
    assert not (out / "_SUCCESS").exists()
    monkeypatch.undo()
    result = invoke("run", str(job))
    assert result.exit_code == 0, result.output
    assert_complete(out, len(PROMPTS))


def test_an_output_path_where_mkdir_fails(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job = write_job(tmp_path, tiny_model, output="/proc/batchrun-test/out")
    result = invoke("run", str(job))
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "'/proc/batchrun-test/out'" in lines[0], result.stderr


@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_damaged_part_is_reported_moved_aside_and_redone(
    tmp_path: Path, tiny_model: Path, with_manifest: bool
) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    assert invoke("run", str(job)).exit_code == 0
    reference = read_output(out)
    victim = out / "part-000001.parquet"
    lost = pq.read_table(victim).num_rows
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # a truncated copy, a disk fault, ...
    if not with_manifest:
        (out / "_progress" / "part-000001.json").unlink()
    checked = invoke("validate", str(job))
    assert checked.exit_code == 0, checked.output
    assert "output: 1 damaged part(s): part-000001.parquet; run will redo their rows" in (
        checked.stdout
    )
    assert f"({len(PROMPTS) - lost} of {len(PROMPTS)} rows committed)" in checked.stdout
    result = invoke("run", str(job))
    assert result.exit_code == 0, result.output
    warnings = result.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("batchrun: warning: "), result.stderr
    assert "part-000001.parquet" in warnings[0]
    assert (out / "_progress" / "damaged" / "part-000001.parquet").read_bytes() == (
        data[: len(data) // 2]
    )
    assert_complete(out, len(PROMPTS))
    redone = read_output(out)
    for column in ("row_index", "completion_token_ids", "finish_reason"):
        assert redone.column(column).equals(reference.column(column)), column


def test_a_manifest_whose_part_is_gone_marks_nothing_done(tmp_path: Path) -> None:
    fingerprint = {"version": 2, "job": "manifests"}
    out = OutputDir(tmp_path / "out")
    out.prepare(fingerprint, overwrite=False)
    schema = output_schema(pa.schema([("prompt", pa.string())]))

    def part(rows: list[int]) -> pa.Table:
        inputs = [pa.record_batch({"prompt": pa.array(["p"], pa.string())}) for _ in rows]
        return build_table(schema, inputs, [error_row(row, "x") for row in rows])

    out.commit(part([0, 1]))
    second = out.commit(part([2, 3]))
    manifest = tmp_path / "out" / "_progress" / "part-000001.json"
    orphan = manifest.read_text()
    second.unlink()  # deleted by hand: its manifest stays behind
    out.prepare(fingerprint, overwrite=False)
    assert not manifest.exists()
    # The next part takes that name; killed between its rename and its manifest, with the
    # orphan still there, it must not pass for rows 2 and 3:
    out.commit(part([4, 5, 6]))
    manifest.write_text(orphan)
    assert OutputDir(tmp_path / "out").done_mask(7).tolist() == [1, 1, 0, 0, 1, 1, 1]


# -- 6. zero-row jobs ----------------------------------------------------------------------------


def test_a_zero_row_job_writes_one_readable_empty_part(tmp_path: Path, tiny_model: Path) -> None:
    source = write_prompts(tmp_path / "in", [])
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    result = invoke("run", str(job))
    assert result.exit_code == 0, result.output
    (part,) = out.glob("part-*.parquet")
    table = pq.read_table(part)
    assert table.num_rows == 0
    assert table.schema.equals(output_schema(pq.read_schema(source)), check_metadata=False)
    assert pl.read_parquet(out / "*.parquet").height == 0
    assert json.loads((out / "stats.json").read_text())["rows"] == 0
    assert (out / "_SUCCESS").exists()


def test_a_shard_without_rows_writes_one_empty_part(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS[:3])  # one row group: more shards than row groups
    job, out = write_job(tmp_path, tiny_model), tmp_path / "out"
    for shard in ("0/3", "2/3"):  # the group's middle row, 1, is in shard 1's share
        assert invoke("run", str(job), "--shard", shard).exit_code == 0
    parts = sorted(out.glob("part-*.parquet"))
    assert [p.name for p in parts] == [
        "part-00000-of-00003-000000.parquet",
        "part-00002-of-00003-000000.parquet",
    ]
    assert all(pq.read_table(part).num_rows == 0 for part in parts)
    assert not (out / "_SUCCESS").exists()
    assert invoke("run", str(job), "--shard", "1/3").exit_code == 0
    assert_complete(out, 3)
    assert pl.read_parquet(out / "*.parquet").height == 3
