"""`batchrun run --workers N`: worker processes on this node share one output, pulling chunks of
row groups through claims; every row is done exactly once, also when a worker is killed with
SIGKILL mid-job; one stats.json and _SUCCESS for the job; what cannot work is refused in one
line."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.config.job import JobSpec
from batchrun.errors import EXIT_STOPPED, JobError
from batchrun.io.input.reader import open_input
from batchrun.io.output.claim import CLAIM_SUFFIX, ClaimInfo
from batchrun.io.output.claim_space import DirectoryClaims
from batchrun.io.output.directory import JOB_KEY, OutputDir
from batchrun.runners.workers.chunks import ChunkPuller, chunk_rows, plan_chunks
from batchrun.runners.workers.devices import worker_devices
from tests.io import test_object_storage as object_storage
from tests.job.test_cli import invoke, write_job, write_prompts

REPO = Path(__file__).resolve().parents[2]
ROWS = 48
WORKER_LINE = re.compile(r"batchrun: worker (\d+)/(\d+) \(pid (\d+)\) on (\S+)")


def part_rows(out: Path) -> list[int]:
    """The row_index of every committed output row (a row twice counts twice)."""
    parts = sorted(out.glob("part-*.parquet"))
    return [i for p in parts for i in pq.read_table(p, columns=["row_index"])[0].to_pylist()]


def worker_rows(out: Path, index: int, count: int) -> int:
    parts = out.glob(f"part-{index:05d}-of-{count:05d}-*.parquet")
    return sum(pq.read_metadata(p).num_rows for p in parts)


def job_file(tmp_path: Path, model: Path) -> Path:
    write_prompts(tmp_path / "in", [f"def handler_{i}(event):" for i in range(ROWS)])
    # Small batches and parts: the job lasts long enough for both workers to pull rows, and a
    # worker commits parts mid-job.
    return write_job(tmp_path, model, max_tokens=24, max_batch_size=2, rows_per_part=2)


def _own_group_with_sigint() -> None:
    """The job in a process group of its own (what a terminal's Ctrl-C reaches), with SIGINT
    not ignored (a shell without job control starts background jobs so)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(job: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", "run", str(job), *flags],
        cwd=job.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_own_group_with_sigint,
    )


def metric_sum(files: list[Path], name: str) -> float:
    """The sum over the files' series of one metric (each file one worker's)."""
    total = 0.0
    for file in files:
        for line in file.read_text().splitlines():
            if line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def assert_stopped(out: Path, stderr: str, signame: str, process: subprocess.Popen[str]) -> None:
    """One stop line and nothing else of note; stats.json for what was committed, no _SUCCESS,
    no worker left running."""
    assert process.returncode == EXIT_STOPPED, stderr
    stop = [line for line in stderr.splitlines() if line.startswith("batchrun: stopped by")]
    assert len(stop) == 1 and stop[0].startswith(f"batchrun: stopped by {signame}:"), stderr
    assert "run the same command again to resume" in stop[0]
    assert "Traceback" not in stderr and "killed by" not in stderr, stderr
    committed = part_rows(out)
    assert len(committed) == len(set(committed)) and f"{len(committed)} rows committed" in stop[0]
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["rows"], stats["workers"]) == (len(committed), 2)
    assert not (out / "_SUCCESS").exists()
    for match in filter(None, map(WORKER_LINE.search, stderr.splitlines())):
        with pytest.raises(ProcessLookupError):  # ended and reaped by the parent
            os.kill(int(match.group(3)), 0)


def wait_for_a_part(out: Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 240
    while not list(out.glob("part-*.parquet")):  # rows are being committed
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def assert_complete(out: Path) -> None:
    assert sorted(part_rows(out)) == list(range(ROWS))  # every row exactly once
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["rows"], stats["ok_rows"], stats["workers"]) == (ROWS, ROWS, 2)
    assert (out / "_SUCCESS").exists()
    assert not list((out / "_claims").rglob("*.claim"))  # the chunk claims are gone
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]


def test_two_cpu_workers_share_the_rows(tmp_path: Path, tiny_model: Path) -> None:
    job = job_file(tmp_path, tiny_model)
    metrics = ["--metrics-file", str(tmp_path / "m.prom")]
    process = start(job, "--workers", "2", "--device", "cpu", *metrics)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    out = tmp_path / "out"
    assert_complete(out)
    # Each worker reports its share of the input: summed over `worker`, the job's rows.
    files = [tmp_path / f"m-{i}.prom" for i in range(2)]
    assert metric_sum(files, "batchrun_input_rows") == ROWS
    assert metric_sum(files, "batchrun_input_rows_done") == ROWS
    assert metric_sum(files, "batchrun_rows_total") == ROWS
    started = [WORKER_LINE.search(line) for line in stderr.splitlines()]
    assert sorted(m.group(1) for m in started if m) == ["0", "1"]
    # Each worker starts on its own half of the chunks: both wrote parts.
    taken = [worker_rows(out, i, 2) for i in range(2)]
    assert all(taken) and sum(taken) == ROWS, taken
    assert f"batchrun: {ROWS} rows ({ROWS} ok, 0 errors)" in stdout
    parts = sorted(p.name for p in out.glob("part-*.parquet"))

    again = start(job, "--workers", "2", "--device", "cpu")  # a second run adds nothing
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert sorted(p.name for p in out.glob("part-*.parquet")) == parts
    assert sorted(part_rows(out)) == list(range(ROWS))


def test_a_killed_worker_s_rows_are_taken_over(tmp_path: Path, tiny_model: Path) -> None:
    job = job_file(tmp_path, tiny_model)
    out = tmp_path / "out"
    process = start(job, "--workers", "2", "--device", "cpu")
    assert process.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr or ()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    pid = None
    while pid is None or not worker_rows(out, 1, 2):  # worker 1 has committed a part
        assert process.poll() is None and time.monotonic() < deadline, lines
        found = [m for m in map(WORKER_LINE.search, list(lines)) if m and m.group(1) == "1"]
        pid = int(found[0].group(3)) if found else None
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # mid-job: it holds claims on rows it has not committed
    process.wait(timeout=300)
    reader.join(timeout=10)
    assert process.returncode == 0, "".join(lines)
    assert any("worker 1" in line and "killed by SIGKILL" in line for line in lines), lines
    assert_complete(out)


def test_sigterm_stops_every_worker_and_the_same_command_resumes(
    tmp_path: Path, tiny_model: Path
) -> None:
    job = job_file(tmp_path, tiny_model)
    out = tmp_path / "out"
    process = start(job, "--workers", "2", "--device", "cpu")
    wait_for_a_part(out, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert_stopped(out, stderr, "SIGTERM", process)

    again = start(job, "--workers", "2", "--device", "cpu")
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert_complete(out)


def test_ctrl_c_to_the_process_group_stops_the_job_in_one_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    """SIGINT to every process of the job's group, as a terminal sends it: the workers stop
    once, cleanly; one stop line, no traceback, no worker said to be killed."""
    job = job_file(tmp_path, tiny_model)
    out = tmp_path / "out"
    process = start(job, "--workers", "2", "--device", "cpu")
    wait_for_a_part(out, process)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    assert_stopped(out, stderr, "SIGINT", process)


def test_a_worker_s_error_stops_the_job_in_one_line(tmp_path: Path, tiny_model: Path) -> None:
    """The input turns unreadable once the parent has checked it and started the workers:
    the workers fail as they open it, and the job ends in the first one's line."""
    job = job_file(tmp_path, tiny_model)
    process = start(job, "--workers", "2", "--device", "cpu")
    assert process.stderr is not None
    lines = [process.stderr.readline()]  # the first worker's line: started, not yet reading
    assert WORKER_LINE.search(lines[0]), lines
    (tmp_path / "in" / "0.parquet").write_bytes(b"not parquet")
    _, rest = process.communicate(timeout=300)
    stderr = lines[0] + rest
    assert process.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("batchrun: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("batchrun: error: worker ") and "0.parquet" in errors[0], errors
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_a_busy_worker_port_or_file_is_refused_before_any_worker_starts(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Worker I serves on port P + I and writes NAME-I.prom: worker 1's port taken, or its
    file a directory, is one line from the parent before any worker starts."""
    job = job_file(tmp_path, tiny_model)
    workers = ["--workers", "2", "--device", "cpu"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = invoke("run", str(job), *workers, "--metrics-port", str(port - 1))
    (tmp_path / "m-1.prom").mkdir()
    directory = invoke("run", str(job), *workers, "--metrics-file", str(tmp_path / "m.prom"))
    for result, says in (
        (busy, f"metrics port {port} on 127.0.0.1 is in use"),
        (directory, f"metrics file '{tmp_path / 'm-1.prom'}' cannot be written: it is a directory"),
    ):
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [f"batchrun: error: {says}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "2", "--tp", "2"], "not with --tp above 1"),
        (["--workers", "2", "--ray"], "with --ray use --replicas"),
        (["--workers", "2", "--shard", "0/2"], "not with --shard"),
        (["--devices", "0"], "--devices needs --workers N above 1"),
        (["--workers", "2", "--device", "cpu", "--devices", "0,1"], "not with --device cpu"),
        (["--workers", "2", "--device", "cuda:1"], "--workers spreads over --devices"),
        (["--workers", "0"], "job key 'workers': 0 is less than the minimum of 1"),
    ],
)
def test_what_cannot_work_is_refused_in_one_line(
    tmp_path: Path, tiny_model: Path, flags: list[str], message: str
) -> None:
    job = job_file(tmp_path, tiny_model)
    for command in ("run", "validate") if "--ray" not in flags else ("run",):  # validate: no --ray
        result = invoke(command, str(job), *flags)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("batchrun: error:"), result.output
        assert message in lines[0]
    assert not (tmp_path / "out").exists()


def devices_of(visible: int, **run: object) -> list[str]:
    job = JobSpec.from_keys({"input": "in", "output": "out", "target": "m", **run})
    return worker_devices(job, visible=visible)


def test_worker_devices() -> None:
    assert devices_of(4, workers=2) == ["cuda:0", "cuda:1"]
    assert devices_of(4, workers=2, devices="3,1") == ["cuda:3", "cuda:1"]
    assert devices_of(0, workers=3) == ["cpu"] * 3  # auto without a GPU: the CPU
    assert devices_of(2, workers=2, device="cpu") == ["cpu", "cpu"]
    for run, message in [
        ({"workers": 3}, "--workers 3 needs a GPU each; this node has 2"),
        ({"workers": 3, "devices": "0,1"}, "--devices 0,1 lists 2"),
        ({"workers": 2, "devices": "0,2"}, "this process sees 2 CUDA device(s)"),
        ({"workers": 2, "devices": "1,1"}, "names a device twice"),
        ({"workers": 2, "device": "cuda"}, None),
    ]:
        if message is None:
            assert devices_of(2, **run) == ["cuda:0", "cuda:1"]
            continue
        with pytest.raises(JobError, match=re.escape(message)):
            devices_of(2, **run)


# -- the chunks and their claims, in one process (two pullers stand for two workers) -----------


def write_input(path: Path, rows: int, group_rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"prompt": [f"p{i}" for i in range(rows)]})
    pq.write_table(table, path, row_group_size=group_rows)


def pulled_rows(batches: list[list[int]]) -> list[int]:
    return sorted(i for batch in batches for i in batch)


def puller(tmp_path: Path, worker: int, size: int = 4) -> ChunkPuller:
    source = open_input(str(tmp_path / "in" / "0.parquet"))
    out = OutputDir.at(str(tmp_path / "out"))
    chunks = plan_chunks(source, size)
    done = out.done_mask(source.total_rows)
    return ChunkPuller(source, out, chunks, size, done, (worker, 2))


def test_chunks_cut_row_groups() -> None:
    assert chunk_rows(48, 2) == 3 and chunk_rows(10**6, 4) == 256 and chunk_rows(3, 8) == 1


def test_a_worker_that_pulls_more_often_takes_more_chunks(tmp_path: Path) -> None:
    write_input(tmp_path / "in" / "0.parquet", rows=40, group_rows=12)  # groups of 12, 12, 12, 4
    fast, slow = puller(tmp_path, 0), puller(tmp_path, 1)
    assert len(fast.chunks) == 10  # each group cut in chunks of 4 rows (the last group: one)
    fast_rows: list[list[int]] = []
    slow_rows: list[list[int]] = []
    fast_batches, slow_batches = fast.batches(), slow.batches()
    slow_done = fast_done = False
    while not (slow_done and fast_done):
        for _ in range(3):  # the fast worker asks for rows three times as often
            batch = None if fast_done else next(fast_batches, None)
            fast_done = batch is None
            if batch is not None:
                fast_rows.append(batch.row_indices.tolist())
        batch = None if slow_done else next(slow_batches, None)
        slow_done = batch is None
        if batch is not None:
            slow_rows.append(batch.row_indices.tolist())
    assert pulled_rows(fast_rows + slow_rows) == list(range(40))  # each row once
    # Each takes its own half front to back; the fast one then takes the slow one's from the
    # back, until the chunks meet.
    assert len(fast_rows) == 8 and len(slow_rows) == 2
    assert slow_rows[0] == [20, 21, 22, 23]  # the slow one started on its own half
    fast.release()
    slow.release()
    assert not list((tmp_path / "out").rglob("*" + CLAIM_SUFFIX))


def test_a_dead_worker_s_chunk_is_taken_over_without_its_committed_rows(tmp_path: Path) -> None:
    write_input(tmp_path / "in" / "0.parquet", rows=8, group_rows=8)
    out = tmp_path / "out"
    # A worker that died mid-chunk: its claim on rows 0-3 and a part with rows 0 and 1.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    directory = out / "_claims" / "chunks" / "rows-0-4"
    directory.mkdir(parents=True)
    info = ClaimInfo.for_this_process((0, 4), (0, 4))
    stale = directory / f"{info.token}{CLAIM_SUFFIX}"
    dead_info = ClaimInfo(**{**info.__dict__, "pid": int(dead.stdout)})
    assert DirectoryClaims(directory).create(stale.name, dead_info.to_json())
    part = pa.table({"row_index": pa.array([0, 1], pa.int64())})
    pq.write_table(part.replace_schema_metadata({JOB_KEY: b"job"}), out / "part-000000.parquet")
    # A live worker (this process) holds rows 4-7.
    live = directory.parent / "rows-4-8"
    live.mkdir()
    live_info = ClaimInfo.for_this_process((4, 8), (4, 8))
    assert DirectoryClaims(live).create(f"held{CLAIM_SUFFIX}", live_info.to_json())

    taking_over = puller(tmp_path, 1)
    assert pulled_rows([b.row_indices.tolist() for b in taking_over.batches()]) == [2, 3]
    assert not stale.exists() and (live / f"held{CLAIM_SUFFIX}").exists()


# -- an object-store output: the claims live in its bucket, or in claims_dir ---------------------

endpoint = object_storage.endpoint  # a moto S3 server on loopback, for this module
bucket = object_storage.bucket


@pytest.mark.parametrize("claims", ["in the bucket", "in claims_dir"])
def test_workers_share_an_s3_output(
    tmp_path: Path, tiny_model: Path, endpoint: str, bucket: str, claims: str
) -> None:
    fs = object_storage.s3(endpoint)
    prompts = object_storage.PROMPTS
    object_storage.put_prompts(fs, f"{bucket}/in", prompts)
    keys = {"claims_dir": "claims"} if claims == "in claims_dir" else {}
    job = object_storage.write_job(tmp_path, tiny_model, bucket, **keys)
    result = invoke("run", str(job), "--workers", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output
    output = object_storage.read_parts(fs, f"{bucket}/out")
    assert output.column("row_index").to_pylist() == list(range(len(prompts)))
    written = object_storage.names(fs, f"{bucket}/out")
    assert "_SUCCESS" in written and not [n for n in written if n.endswith(".tmp")]
    with fs.open_input_stream(f"{bucket}/out/stats.json") as stream:
        assert json.loads(stream.read())["rows"] == len(prompts)
    assert not object_storage.claims_in(fs, f"{bucket}/out")  # released, the chunks' too
    local_claims = tmp_path / "claims"
    assert local_claims.exists() == (claims == "in claims_dir")  # where the claims lived
    assert not list(local_claims.rglob("*" + CLAIM_SUFFIX))


def test_a_killed_worker_s_chunks_in_the_bucket_are_taken_over(
    tmp_path: Path, tiny_model: Path, endpoint: str, bucket: str
) -> None:
    """kill -9 of a worker mid-job, its chunk claims in the bucket: the other worker takes its
    rows over, each row is written once, and no claim is left."""
    fs = object_storage.s3(endpoint)
    prompts = [f"def handler_{i}(event):" for i in range(ROWS)]
    object_storage.put_prompts(fs, f"{bucket}/in", prompts)
    job = object_storage.write_job(
        tmp_path, tiny_model, bucket, max_tokens=24, max_batch_size=2, rows_per_part=2
    )
    process = start(job, "--workers", "2", "--device", "cpu")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr or ()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    pid = None
    written = lambda: object_storage.names(fs, f"{bucket}/out")  # noqa: E731
    while pid is None or not any(n.startswith("part-00001-of-00002") for n in written()):
        assert process.poll() is None and time.monotonic() < deadline, lines
        found = [m for m in map(WORKER_LINE.search, list(lines)) if m and m.group(1) == "1"]
        pid = int(found[0].group(3)) if found else None
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # mid-job: it holds chunk claims on rows it has not committed
    process.wait(timeout=300)
    reader.join(timeout=10)
    assert process.returncode == 0, "".join(lines)
    assert any("worker 1" in line and "killed by SIGKILL" in line for line in lines), lines
    output = object_storage.read_parts(fs, f"{bucket}/out")
    assert output.column("row_index").to_pylist() == list(range(ROWS))  # each row once
    assert "_SUCCESS" in written() and not object_storage.claims_in(fs, f"{bucket}/out")
