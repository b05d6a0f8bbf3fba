"""Grammars compile off the step loop, in processes (issue 32, item 4): a row waits only for its
own grammar while the others decode; identical constraints compile once; a constraint over
max_constraint_bytes, or whose compile runs past grammar_compile_timeout, is its row's error
row (a job key's: the job is refused, by `validate` too, without waiting for the compile), and a
compile given up has its process killed; a stop signal during a compile stops the run as ever,
and the compile's process ends with it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from batchrun.config.job import JobSpec
from batchrun.engine.compiling import Compiling
from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.core.scheduler import Scheduler
from batchrun.errors import EXIT_STOPPED
from batchrun.runners.local import run_job
from batchrun.sampling import grammar_compile
from batchrun.sampling.constraint import Constraint
from batchrun.sampling.grammar_compile import CompileBudget, CompileJob, CompilePool
from batchrun.sampling.params import SamplingParams
from tests.cluster.test_sigterm import parse_stop, part_rows
from tests.helpers.engine_runs import cpu_engine
from tests.io.test_output_safety import ONE_THREAD_ENV, REPO
from tests.job.test_cli import assert_one_line_error, invoke, write_job, write_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = Path(__file__).resolve().parents[2] / "batchrun" / "demo" / "target"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"def [a-z_]{1,12}\((x|y|z)\): return [0-9]{1,3}"
# A compile process that answers "compiled P" to a payload P, and never to "stuck".
FAKE_WORKER = """
import sys, time
from batchrun.sampling.compile_worker import READY, receive, send
questions, answers = sys.stdin.buffer, sys.stdout.buffer
receive(questions)
send(answers, (READY, None))
while True:
    try:
        payload = receive(questions)
    except EOFError:
        break
    if payload == "stuck":
        time.sleep(3600)
    send(answers, ("compiled " + payload, None))
"""
# The real compile process, but its compile of the constraint value argv[2] waits until the file
# argv[1] exists (writing its pid to argv[1] + ".pid" meanwhile).
HELD_WORKER = """
import os, sys, time
from batchrun.sampling import compile_worker, constraint
release, held = sys.argv[1], sys.argv[2]
compile_now = constraint.compile_constraint
def compile_held(compiler, constraint):
    if constraint.value == held:
        with open(release + ".pid", "w") as pid:
            pid.write(str(os.getpid()))
        while not os.path.exists(release):
            time.sleep(0.01)
    return compile_now(compiler, constraint)
constraint.compile_constraint = compile_held
compile_worker.main()
"""


def enum(count: int) -> str:
    """A schema of `count` enum strings: 40,000 (640 KB) compile for seconds at a 1,024-token
    vocabulary (70,000, 1.1 MB, for minutes at Qwen3's)."""
    return json.dumps({"enum": [f"value_{i:06d}" for i in range(count)]})


def script(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def gone(pid: int, seconds: float = 30) -> bool:
    """Whether the process ends within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


# -- the pool ------------------------------------------------------------------------------------


def test_a_compile_past_its_budget_is_killed_and_the_compiles_behind_it_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammar_compile, "WORKER", (script(tmp_path / "w.py", FAKE_WORKER),))
    pool = CompilePool(CompileBudget(seconds=0.5, max_bytes=100), "setup", processes=1)
    stuck = pool.submit("stuck", "regex", 10, "stuck")
    behind = pool.submit("behind", "regex", 10, "behind")
    pool.wait([stuck], 60)
    assert stuck.process is None and stuck.result is None
    assert stuck.error == "regex did not compile within grammar_compile_timeout (0.5 s)"
    pool.wait([behind], 60)  # in the process started after the stuck one was killed
    assert behind.result == "compiled behind" and behind.error is None
    # Identical constraints compile once: a result, or a failure, is kept for the next.
    assert pool.submit("stuck", "regex", 10, "stuck") is stuck
    assert pool.submit("behind", "regex", 10, "behind") is behind
    over = pool.submit("big", "json_schema", 101, "big")
    assert (
        over.done and over.error == "json_schema is 101 bytes, more than max_constraint_bytes (100)"
    )
    (process,) = pool._processes
    pool.close()
    assert gone(process.pid)


def test_the_cache_keeps_what_fits_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammar_compile, "WORKER", (script(tmp_path / "w.py", FAKE_WORKER),))
    pool = CompilePool(CompileBudget(), "setup", processes=1, cache_bytes=30)
    first = pool.submit("a", "regex", 10, "a")
    pool.wait([first], 60)
    pool.wait([pool.submit("b", "regex", 10, "b")], 60)  # 20 bytes each: a (the older) leaves
    again = pool.submit("a", "regex", 10, "a")
    assert again is not first
    pool.wait([again], 60)
    assert again.result == "compiled a"
    pool.close()


# -- the engine: the others decode while one row's grammar compiles --------------------------


def test_a_row_waits_only_for_its_own_grammar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = Constraint("json_schema", json.dumps(SCHEMA))
    release = tmp_path / "release"
    worker = script(tmp_path / "held.py", HELD_WORKER)
    monkeypatch.setattr(grammar_compile, "WORKER", (worker, str(release), slow.value))
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    engine = cpu_engine(TARGET, None, max_batch_size=4, num_pages=256)
    fast = Constraint("regex", REGEX)
    prompts = ["def parse(items):\n    result = ", "import os\n", "def f(x):", "import re\n"]
    requests = [
        Request(i, tokenizer.encode(p), SamplingParams(max_tokens=48, constraint=c))
        for i, (p, c) in enumerate(zip(prompts, [slow, fast, None, fast], strict=True))
    ]
    for req in requests:
        engine.add(req)  # does not wait for a compile
    jobs = {req.row_index: job for req, job in engine.compiling.waiting}
    assert jobs[1] is jobs[3]  # two rows, one compile
    finished: list[Request] = []
    while len(finished) < 3:
        finished += engine.step()
    assert sorted(r.row_index for r in finished) == [1, 2, 3]
    assert engine.num_unfinished == 1 and not requests[0].output.token_ids
    release.touch()
    while engine.num_unfinished:
        finished += engine.step()
    last = finished[-1]
    assert last.row_index == 0 and last.output.finish_reason == "stop" and last.output.error is None
    jsonschema.validate(json.loads(tokenizer.decode(last.output.token_ids[:-1])), SCHEMA)
    for req in finished[:3]:
        if req.params.constraint is not None:
            assert re.fullmatch(REGEX, tokenizer.decode(req.output.token_ids[:-1]))


# -- a job: the rows over a budget are error rows, the others finish ---------------------------


def test_rows_over_the_budgets_are_error_rows_and_the_others_finish(tmp_path: Path) -> None:
    big = enum(50_000)
    schemas = [json.dumps(SCHEMA), enum(40_000), json.dumps(SCHEMA), None, big, json.dumps(SCHEMA)]
    (tmp_path / "in").mkdir()
    prompts = [f"def step_{i}(state):" for i in range(len(schemas))]
    pq.write_table(
        pa.table({"prompt": prompts, "json_schema": pa.array(schemas, pa.string())}),
        tmp_path / "in" / "rows.parquet",
    )
    spec = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(TARGET),
            max_tokens=48,
            device="cpu",
            dtype="float32",
            quiet=True,
            max_batch_size=2,
            grammar_compile_timeout=1,
            max_constraint_bytes=700_000,
        )
    )
    run_job(spec)
    rows = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("row_index").to_dicts()
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, False, False, True, False]
    late = "json_schema did not compile within grammar_compile_timeout (1 s)"
    assert rows[1]["error"] == late and rows[1]["completion"] is None
    assert rows[4]["error"] == (
        f"json_schema is {len(big):,} bytes, more than max_constraint_bytes (700,000)"
    )
    for row in (rows[0], rows[2], rows[5]):
        assert row["error"] is None
        jsonschema.validate(json.loads(row["completion"]), SCHEMA)


def test_validate_refuses_a_job_schema_over_a_budget_without_waiting(
    tmp_path: Path, tiny_model: Path
) -> None:
    write_prompts(tmp_path / "in", ["def f(x):"])
    job = str(write_job(tmp_path, tiny_model))
    started = time.monotonic()
    slow = enum(40_000)
    result = invoke("validate", job, "--json-schema", slow, "--grammar-compile-timeout", "1")
    late = "job key 'json_schema': json_schema did not compile within grammar_compile_timeout"
    assert_one_line_error(result, late)
    result = invoke("validate", job, "--json-schema", slow, "--max-constraint-bytes", "1000")
    assert_one_line_error(result, f"json_schema is {len(slow):,} bytes, more than")
    assert time.monotonic() - started < 30  # the compile alone takes seconds; no waiting for it


# -- a stop signal during a compile ------------------------------------------------------------

# `batchrun run JOB` with the held compile process of argv[2:].
HELD_RUN = """
import sys
from batchrun.sampling import grammar_compile
grammar_compile.WORKER = tuple(sys.argv[2:])
from batchrun.cli import cli
cli(["run", sys.argv[1]])
"""


def test_a_signal_during_a_compile_stops_the_run_at_once(tmp_path: Path, tiny_model: Path) -> None:
    """A row's compile never ends; the other rows finish and are committed, and SIGTERM stops
    the run without waiting for the compile, whose process ends with it; the next run
    resumes."""
    (tmp_path / "in").mkdir()
    table = pa.table(
        {
            "prompt": [f"def f{i}(x):" for i in range(4)],
            "regex": pa.array([None, "held", None, None], pa.string()),
        }
    )
    pq.write_table(table, tmp_path / "in" / "rows.parquet")
    job = write_job(tmp_path, tiny_model, rows_per_part=1, max_tokens=8)
    out, release = tmp_path / "out", tmp_path / "release"
    worker = script(tmp_path / "held.py", HELD_WORKER)
    command = [sys.executable, "-c", HELD_RUN, str(job), worker, str(release), "held"]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=ONE_THREAD_ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        held = tmp_path / "release.pid"  # written once the compile is held
        deadline = time.monotonic() + 120
        while not (held.exists() and len(part_rows(out)) == 3) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1]
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)  # a compile waited for would hold it forever
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == EXIT_STOPPED, stderr
    assert parse_stop(stderr.strip())[1:] == (3, 3, 1)
    assert gone(int(held.read_text()))  # the compile process too
    again = invoke("run", str(job))  # a compile that ends this time
    assert again.exit_code == 0, again.output
    assert sorted(part_rows(out)) == [0, 1, 2, 3]


# -- tensor parallelism: rank 0's view decides ----------------------------------------------


class Rank0:
    """A tensor-parallel group whose rank 0 sees `states`."""

    def __init__(self, states: list[object]) -> None:
        self.states = states

    def of_first(self, value: object) -> object:
        return self.states


class LateGrammars:
    """This rank's compiles: none over yet; waiting for one ends it, compiled."""

    def __init__(self) -> None:
        self.waited: list[CompileJob] = []

    def poll(self, job: CompileJob) -> bool:
        return job.done

    def wait(self, jobs: list[CompileJob], seconds: float | None) -> None:
        self.waited += jobs
        for job in jobs:
            job._finish("compiled", None)


def test_a_rank_follows_rank_0_and_waits_for_its_own_compile() -> None:
    rank0 = Rank0([True, "regex did not compile within grammar_compile_timeout (1 s)", None])
    scheduler = Scheduler(PagePool(4, 4), 1, 16, decode_width=1)  # it finishes the failed
    compiling = Compiling(rank0, scheduler.fail)  # type: ignore[arg-type]
    requests = [Request(i, [1, 2], SamplingParams()) for i in range(3)]
    jobs = [CompileJob("regex", str(i), 1) for i in range(3)]
    for req, job in zip(requests, jobs, strict=True):
        compiling.add(req, job)
    grammars = LateGrammars()
    ready, failed = compiling.settle(grammars)  # type: ignore[arg-type]
    assert ready == [(requests[0], jobs[0])] and grammars.waited == [jobs[0]]
    assert failed == [requests[1]] and requests[1].output.finish_reason == "error"
    assert requests[1].output.error == rank0.states[1]  # rank 0's reason, whatever this rank's was
    assert [req for req, _ in compiling.waiting] == [requests[2]]
