"""SIGTERM and SIGINT stop `batchrun run` cleanly: no more rows are admitted, the requests in
flight are dropped, every finished row is committed, stats.json is written, the claim is
released, one line on stderr counts the rows and the exit status is EXIT_STOPPED; running the
same command again does the rest, each row once. A second signal ends the process at once, and
still nothing is half-written."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerBase

from batchrun.config.job import JobSpec
from batchrun.errors import EXIT_STOPPED, JobStopped
from batchrun.io.input.prompts import RequestBuilder
from batchrun.runners import local, stop_signals
from batchrun.runners.local import run_job
from tests.cluster.test_pipeline import FakeEngine, make_job, write_input
from tests.io.test_output_safety import start
from tests.job.test_cli import invoke, write_job, write_prompts

pytestmark = pytest.mark.usefixtures("one_thread", "sigint_not_ignored")


@pytest.fixture
def sigint_not_ignored() -> Iterator[None]:
    """A shell without job control starts a background job with SIGINT ignored (`cmd &` in a
    script, `nohup`), and run_job rightly leaves an ignored SIGINT alone; these tests send
    SIGINT to this process, so they take it back for their duration."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous is not None:  # None: a handler not set from Python, left as it is
        signal.signal(signal.SIGINT, previous)


STOP_LINE = re.compile(
    r"batchrun: stopped by (SIG\w+): (\d+) rows committed \((\d+) in this run\), "
    r"(\d+) left for the next run; run the same command again to resume"
)
ROWS = 120


def part_rows(out: Path) -> list[int]:
    """The row_index of every committed output row (a row twice counts twice)."""
    parts = sorted(out.glob("part-*.parquet"))
    return [i for p in parts for i in pq.read_table(p, columns=["row_index"])[0].to_pylist()]


def parse_stop(line: str) -> tuple[str, int, int, int]:
    match = STOP_LINE.fullmatch(line)
    assert match, line
    name, committed, this_run, left = match.groups()
    return name, int(committed), int(this_run), int(left)


def assert_nothing_left_behind(out: Path) -> None:
    """The claim is released and no temp file is left (every part is whole)."""
    assert not list((out / "_claims").iterdir())
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]
    for part in out.glob("part-*.parquet"):
        pq.read_metadata(part)


def run_until_committed(
    job: Path, out: Path, signals: list[int], *flags: str
) -> tuple[int, str, set[int]]:
    """Start `batchrun run job flags`, send `signals` (one after another) once a part is
    committed; returns its exit status, its stderr and the rows committed before the first."""
    process = start(job, *flags)
    seen: set[int] | None = None
    try:
        while process.poll() is None:
            if list(out.glob("part-*.parquet")):
                seen = set(part_rows(out))  # parts are renamed into place: each is whole
                for signum in signals:
                    os.kill(process.pid, signum)
                break
            time.sleep(0.002)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert seen is not None, f"the run finished before a part was committed: {stderr}"
    return process.returncode, stderr, seen


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_commits_what_finished_and_the_same_command_resumes(
    tmp_path: Path, tiny_model: Path, signum: int
) -> None:
    write_prompts(
        tmp_path / "in", [f"class Model{i}:\n    def forward(self, x):" for i in range(ROWS)]
    )
    job = write_job(tmp_path, tiny_model, rows_per_part=4, max_batch_size=4, max_tokens=8)
    out = tmp_path / "out"
    status, stderr, seen = run_until_committed(job, out, [signum])

    assert status == EXIT_STOPPED, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    name, committed, this_run, left = parse_stop(lines[0])
    assert name == signal.Signals(signum).name
    rows = part_rows(out)
    assert len(rows) == len(set(rows)) == committed == this_run  # each once; a fresh output
    assert seen <= set(rows)  # nothing committed before the signal is lost
    assert committed + left == ROWS and left > 0
    assert not (out / "_SUCCESS").exists()
    assert json.loads((out / "stats.json").read_text())["rows"] == committed
    assert_nothing_left_behind(out)
    kept = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}

    again = invoke("run", str(job))  # the claim is free: no complaint, no warning
    assert again.exit_code == 0 and again.stderr == "", again.output
    assert sorted(part_rows(out)) == list(range(ROWS))  # each row exactly once
    assert all((out / name).read_bytes() == data for name, data in kept.items())  # not redone
    assert (out / "_SUCCESS").exists()
    assert_nothing_left_behind(out)


@pytest.mark.slow
def test_a_second_signal_ends_the_run_at_once_and_leaves_no_half_written_part(
    tmp_path: Path, tiny_model: Path
) -> None:
    write_prompts(tmp_path / "in", [f"def f{i}(x):" for i in range(ROWS)])
    job = write_job(tmp_path, tiny_model, rows_per_part=4, max_batch_size=4, max_tokens=8)
    out = tmp_path / "out"
    status, stderr, seen = run_until_committed(job, out, [signal.SIGTERM, signal.SIGTERM])
    if status == EXIT_STOPPED:  # the first stop was done before the second signal came
        assert len(stderr.splitlines()) == 1, stderr
    else:
        assert status == -signal.SIGTERM and stderr == ""
    rows = part_rows(out)
    assert len(rows) == len(set(rows)) and seen <= set(rows)
    assert not (out / "_SUCCESS").exists()
    for part in out.glob("part-*.parquet"):
        pq.read_metadata(part)  # whole: a part is written to a temp file, then renamed
    again = invoke("run", str(job))  # takes the killed run's claim over
    assert again.exit_code == 0, again.output
    assert sorted(part_rows(out)) == list(range(ROWS))
    assert_nothing_left_behind(out)


class SignalAtStep(FakeEngine):
    """Sends this process `signum` during step `at`; counts the samples finished by then."""

    def __init__(self, *args: Any, signum: int, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.signum, self.at = signum, at
        self.finished: dict[int, int] = {}  # row_index -> its samples finished
        self.aborted = False

    def step(self) -> list[Any]:
        finished = super().step()
        if self.steps == self.at:
            os.kill(os.getpid(), self.signum)  # the handler only records it: the step returns
        for request in finished:
            self.finished[request.row_index] = self.finished.get(request.row_index, 0) + 1
        return finished

    def abort_all(self) -> None:
        self.aborted = True
        self.waiting, self.running = [], []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_rows_finished_before_the_signal_are_committed_whole(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase, signum: int
) -> None:
    write_input(tmp_path / "in", rows=60)
    before = {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS}
    # No part fills up before the signal: what is committed, the stop flushed.
    job = make_job(tmp_path, rows_per_part=1000, part_seconds=3600.0, n=2, schedule_window=0)
    engine = SignalAtStep(tokenizer, signum=signum, at=12)
    with pytest.raises(JobStopped) as stopped:
        run_job(job, engine)
    assert {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS} == before  # put back
    assert engine.steps == 12 and engine.aborted  # not one step more; in flight: dropped
    out = tmp_path / "out"
    assert [p.name for p in out.glob("part-*.parquet")] == ["part-000000.parquet"]
    table = pq.read_table(out / "part-000000.parquet")
    samples: dict[int, list[int]] = {}
    for row in table.select(["row_index", "sample_index", "error"]).to_pylist():
        samples.setdefault(row["row_index"], []).append(row["sample_index"])
    assert all(sorted(s) == [0, 1] for s in samples.values())  # never part of a row
    ok = set(table.filter(pa.compute.is_null(table["error"]))["row_index"].to_pylist())
    assert ok == {row for row, done in engine.finished.items() if done == 2}
    assert stopped.value.line is not None
    name, committed, this_run, left = parse_stop(stopped.value.line)
    assert name == signal.Signals(signum).name
    assert committed == this_run == len(samples) and committed + left == 60 and left > 0
    assert json.loads((out / "stats.json").read_text())["rows"] == 2 * committed
    assert not (out / "_SUCCESS").exists()
    assert_nothing_left_behind(out)

    run_job(job, FakeEngine(tokenizer))  # resumes: every sample of every row once
    final = pa.concat_tables(pq.read_table(p) for p in out.glob("part-*.parquet"))
    pairs = sorted(final.select(["row_index", "sample_index"]).to_pylist(), key=repr)
    pairs = sorted((p["row_index"], p["sample_index"]) for p in pairs)
    assert pairs == [(row, sample) for row in range(60) for sample in (0, 1)]
    assert (out / "_SUCCESS").exists()


def test_a_signal_while_waiting_for_input_is_not_held_up(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch thread is stuck reading (a slow file system, a long tokenization): the stop
    does not wait for it."""
    write_input(tmp_path / "in", rows=40, files=4)
    release = threading.Event()
    build_batch = RequestBuilder.build_batch
    calls = []

    def slow_build(self: RequestBuilder, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            release.wait(30)  # stuck, until the test ends
        return build_batch(self, *args, **kwargs)

    monkeypatch.setattr(RequestBuilder, "build_batch", slow_build)
    job = make_job(tmp_path, rows_per_part=4, schedule_window=0)
    started = time.monotonic()
    try:
        with pytest.raises(JobStopped) as stopped:
            run_job(job, FakeEngine(tokenizer, batch=64))
    finally:
        release.set()
    assert time.monotonic() - started < 20
    assert stopped.value.line is not None
    _, committed, _, left = parse_stop(stopped.value.line)
    assert committed == len(set(part_rows(tmp_path / "out"))) and left > 0
    assert_nothing_left_behind(tmp_path / "out")


def test_a_signal_in_start_up_stops_at_once(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_prompts(tmp_path / "in", ["def f(x):"] * 8)
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tiny_model),
            quiet=True,
        )
    )

    def loading(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # a long model load: the signal raises at once
        raise AssertionError("not stopped")

    monkeypatch.setattr(local, "build_engine", loading)
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(JobStopped) as stopped:
        run_job(job)
    assert time.monotonic() - started < 20
    assert stopped.value.line is not None
    assert parse_stop(stopped.value.line) == ("SIGTERM", 0, 0, 8)
    assert signal.getsignal(signal.SIGTERM) is before
    assert_nothing_left_behind(tmp_path / "out")


def test_overwriting_jobs_are_told_how_to_resume() -> None:
    line = stop_signals.stop_line(signal.SIGTERM, 5, 2, 7, overwrite=True)
    assert line.endswith("run the same command with --no-overwrite to resume")
    assert stop_signals.stop_line(signal.SIGINT, 5, 2, 7, overwrite=False) == (
        "batchrun: stopped by SIGINT: 5 rows committed (2 in this run), 7 left for the next "
        "run; run the same command again to resume"
    )


def test_outside_the_main_thread_the_signals_are_left_alone(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_input(tmp_path / "in", rows=10)
    results: list[dict[str, Any] | BaseException] = []

    def work() -> None:
        try:
            results.append(run_job(make_job(tmp_path), FakeEngine(tokenizer)))
        except BaseException as exc:
            results.append(exc)

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert isinstance(results[0], dict) and results[0]["input_rows"] == 10
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_tensor_parallel_ranks_stop_together_when_the_launcher_is_signalled(
    tmp_path: Path, tiny_model: Path
) -> None:
    """`--tp 2` re-executes under torchrun: a SIGTERM to the batchrun process alone (a
    container's main process, `timeout`, `kill PID`) goes on to torchrun, which passes it to the
    ranks; they stop at one step, rank 0 commits and says so, and the launcher exits
    EXIT_STOPPED (torchrun adds its own lines on stderr)."""
    write_prompts(tmp_path / "in", [f"def g{i}(y):" for i in range(ROWS)])
    job = write_job(tmp_path, tiny_model, rows_per_part=4, max_batch_size=4, max_tokens=8)
    out = tmp_path / "out"
    status, stderr, seen = run_until_committed(job, out, [signal.SIGTERM], "--tp", "2")
    assert status == EXIT_STOPPED, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("batchrun: ")]
    assert len(lines) == 1, stderr
    _, committed, this_run, left = parse_stop(lines[0])
    rows = part_rows(out)
    assert len(rows) == len(set(rows)) == committed == this_run and seen <= set(rows)
    assert committed + left == ROWS and left > 0 and not (out / "_SUCCESS").exists()
    assert_nothing_left_behind(out)
    again = invoke("run", str(job))
    assert again.exit_code == 0, again.output
    assert sorted(part_rows(out)) == list(range(ROWS))


def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path: Path) -> None:
    """A Ctrl-C in the seconds `batchrun` spends importing torch (before any of a command's own
    handling) ends as a stop before the job started: one line, EXIT_STOPPED, no traceback. The
    signal goes to the process group, as a terminal sends it, once torch's library is mapped."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", "validate", str(tmp_path / "job.toml")],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    maps = Path(f"/proc/{child.pid}/maps")
    deadline = time.monotonic() + 60
    while "libtorch" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(child.pid, signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == EXIT_STOPPED, err
    assert err.splitlines() == [
        "batchrun: stopped by SIGINT before the job started; run the same command again to start it"
    ]
