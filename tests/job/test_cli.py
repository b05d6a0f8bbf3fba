"""The command line over real tiny checkpoints: run, validate, stats, one-line errors, kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.io.output.columns import OutputRow, build_table, output_schema
from batchrun.io.output.stats import StatsAccumulator
from batchrun.runners import local
from batchrun.runners.engine_feed import EngineLike
from batchrun.tools.tiny_draft import make_tiny_draft

REPO = Path(__file__).resolve().parents[2]
# Tiny models run fastest on one thread; more only contend with other processes for the cores.
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def write_job(tmp_path: Path, model: Path, extra: str = "", **keys: int) -> Path:
    settings = {"max_tokens": 6, "rows_per_part": 4, "max_batch_size": 4, **keys}
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{model}"\nquiet = true\n'
        + "".join(f"{key} = {value}\n" for key, value in settings.items())
        + extra
    )
    return job


def write_prompts(directory: Path, prompts: Sequence[str | None], files: int = 1) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"prompt": pa.array(prompts, pa.string()), "number": list(range(len(prompts)))}
    )
    per_file = -(-len(prompts) // files)
    for number in range(files):
        pq.write_table(table.slice(number * per_file, per_file), directory / f"{number}.parquet")


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")


def assert_one_line_error(result: Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), result.stderr
    assert message in lines[0]


PROMPTS = [f"def step_{i}(state):" for i in range(10)] + ["", None, "import os"]


def test_run_and_stats_end_to_end(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS, files=3)
    result = invoke("run", str(write_job(tmp_path, tiny_model)), "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    # One process is --workers 1: its stats.json says so, as every --workers N job's does.
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["workers"] == 1
    out = read_output(tmp_path / "out")
    assert (
        out.column("row_index").to_pylist() == out.column("number").to_pylist() == list(range(13))
    )
    assert out.column("finish_reason").to_pylist().count("error") == 2
    for row in out.to_pylist():
        if row["error"] is None:
            assert isinstance(row["completion"], str)
            assert 1 <= row["completion_tokens"] <= 5 and row["finish_reason"] in ("stop", "length")
            assert len(row["completion_token_ids"]) == row["completion_tokens"]
    assert (tmp_path / "out" / "_SUCCESS").exists() and (tmp_path / "out" / "stats.json").exists()
    summary = invoke("stats", str(tmp_path / "out"))
    assert summary.exit_code == 0
    assert "rows: 13 (11 ok, 2 errors)" in summary.output
    assert "prompt is empty" in summary.output and "prompt is null" in summary.output


def test_a_draft_fills_the_speculation_columns(tmp_path: Path, tiny_model: Path) -> None:
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4)
    write_prompts(tmp_path / "in", PROMPTS[:6])
    job = str(write_job(tmp_path, tiny_model, max_tokens=12))
    assert invoke("run", job, "--output", str(tmp_path / "plain")).exit_code == 0
    result = invoke("run", job, "--draft", str(draft), "--verify-width", "full")
    assert result.exit_code == 0, result.output
    speculative, plain = read_output(tmp_path / "out"), read_output(tmp_path / "plain")
    assert speculative.column("completion").equals(plain.column("completion"))  # greedy: same text
    for row in speculative.to_pylist():
        hist, capped = row["spec_accept_hist"], row["spec_capped_hist"]
        assert len(hist) == 4 and sum(hist) == row["spec_rounds"]
        assert row["completion_tokens"] == 1 + sum(k * hist[k - 1] for k in range(1, 5))
        assert capped[:3] == [0, 0, 0] and capped[3] == hist[3]  # full width: only at B
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["block_size"] == 4 and stats["spec_rounds"] > 0
    assert stats["acceptance_length"] >= 1 and len(stats["per_position_acceptance"]) == 3
    # At the full block the drafter's estimate is what the rounds committed.
    assert stats["drafter_acceptance_length"] == pytest.approx(stats["acceptance_length"])
    assert "per-position acceptance" in invoke("stats", str(tmp_path / "out")).output
    # The adaptive width: plain-decoding steps are not rounds, the drafter's tau is estimated.
    result = invoke("run", job, "--draft", str(draft), "--output", str(tmp_path / "auto"))
    assert result.exit_code == 0, result.output
    auto = json.loads((tmp_path / "auto" / "stats.json").read_text())
    assert auto["drafter_acceptance_length"] is not None
    assert auto["tokens_per_target_forward"] >= 1
    assert read_output(tmp_path / "auto").column("completion").equals(plain.column("completion"))


def test_chat_rows_use_the_chat_template(tmp_path: Path, tiny_model: Path) -> None:
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    rows = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": None}],
    ]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"messages": pa.array(rows, messages)}), tmp_path / "in" / "c.parquet")
    assert invoke("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    first, second = read_output(tmp_path / "out").to_pylist()
    assert first["error"] is None and first["prompt_tokens"] > 4
    assert second["error"].startswith("malformed chat row")


def test_validate_reports_what_it_found(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS, files=2)
    result = invoke("validate", str(write_job(tmp_path, tiny_model, 'id_column = "number"\n')))
    assert result.exit_code == 0, result.output
    assert "input: 2 file(s), 13 rows" in result.output
    assert "prompt column: prompt (text)" in result.output
    assert "id column: n" in result.output
    assert not (tmp_path / "out").exists()  # validate runs nothing


@pytest.mark.parametrize(
    ("extra", "flags", "message"),
    [
        ("colour = 1\n", [], "unknown job key 'colour'"),
        ("", ["--top-p", "2"], "job key 'top_p'"),
        ("", ["--target", "missing-model"], "target model directory"),
        ("", ["--target", "."], "no config.json"),
        ("", ["--input", "nothing.parquet"], "does not exist"),
        ("", ["--prompt-column", "text"], "prompt_column 'text' is not an input column"),
        ('prompt_column = "number"\n', [], "prompt column 'number' must be string"),
    ],
)
def test_job_errors_are_one_line_and_exit_2(
    tmp_path: Path,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    extra: str,
    flags: list[str],
    message: str,
) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    monkeypatch.chdir(tmp_path)  # relative flags resolve against the working directory
    assert_one_line_error(
        invoke("run", str(write_job(tmp_path, tiny_model, extra)), *flags), message
    )


def test_stats_and_validate_errors(tmp_path: Path) -> None:
    assert_one_line_error(invoke("stats", str(tmp_path)), "no part files")
    assert_one_line_error(invoke("validate", str(tmp_path / "none.toml")), "cannot read job file")


def test_unreadable_input_as_a_real_process(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "broken.parquet").write_text("not parquet")
    done = subprocess.run(
        [sys.executable, "-m", "batchrun.cli", "run", str(write_job(tmp_path, tiny_model))],
        cwd=REPO,
        env=ONE_THREAD_ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("batchrun: error: cannot read input file")
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def kill_when(job: Path, ready: Callable[[], bool]) -> bool:
    """Start `batchrun run job`, SIGKILL it once ready() holds; False if it finished first."""
    process = subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", "run", str(job)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        env=ONE_THREAD_ENV,
    )
    try:
        while process.poll() is None:
            if ready():
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
                return True
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""
    return False


def kill_three_times(job: Path, out: Path) -> list[bool]:
    """kill_when thrice: before any part is written, after the first, after the third."""

    def parts() -> int:
        return len(list(out.glob("part-*.parquet")))

    return [
        kill_when(job, lambda: (out / "_progress" / "job.json").exists()),
        kill_when(job, lambda: parts() >= 1),
        kill_when(job, lambda: parts() >= 3),
    ]


@pytest.mark.slow
def test_kill_9_and_rerun_gives_every_row_once(tmp_path: Path, tiny_model: Path) -> None:
    rows = 12
    prompts = [f"class Model{i}:\n    def forward(self, x):" for i in range(rows)]
    write_prompts(tmp_path / "in", prompts, files=2)
    job = write_job(tmp_path, tiny_model, rows_per_part=2, max_batch_size=2, max_tokens=6)
    reference = invoke("run", str(job), "--output", str(tmp_path / "reference"))
    assert reference.exit_code == 0, reference.output
    out = tmp_path / "out"
    assert kill_three_times(job, out)[0], "the first run finished before it could be killed"
    committed = read_output(out).column("row_index").to_pylist()
    assert len(committed) == len(set(committed)) < rows  # nothing twice, and work was left
    assert invoke("run", str(job)).exit_code == 0
    resumed, expected = read_output(out), read_output(tmp_path / "reference")
    assert resumed.column("row_index").to_pylist() == list(range(rows))
    for column in ("completion", "completion_token_ids", "finish_reason", "prompt_tokens"):
        assert resumed.column(column).equals(expected.column(column)), column
    assert (out / "_SUCCESS").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_repeatable_flags_work_on_the_command_line(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS[:3])
    job = str(write_job(tmp_path, tiny_model))
    result = invoke("run", job, "--stop", "foo", "--stop", "\n", "--stop-token-ids", "5")
    assert result.exit_code == 0, result.output
    assert read_output(tmp_path / "out").num_rows == 3


def test_the_run_summary_goes_to_stdout_also_when_quiet(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    result = invoke("run", str(write_job(tmp_path, tiny_model)), "--quiet")  # quiet in both
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("batchrun: 13 rows (11 ok, 2 errors), ")
    assert f"-> {tmp_path / 'out'}" in result.stdout
    assert result.stderr == ""  # no progress bar, no per-row error lines


def test_tokens_per_second_times_generation_only(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = local.build_engine
    load_time = 1.0

    def slow_build(*args: Any) -> EngineLike:
        time.sleep(load_time)  # a model that takes a while to load
        return build(*args)

    monkeypatch.setattr(local, "build_engine", slow_build)
    write_prompts(tmp_path / "in", PROMPTS)
    assert invoke("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["load_seconds"] >= load_time
    assert stats["generation_seconds"] == pytest.approx(
        stats["wall_seconds"] - stats["load_seconds"], abs=0.002
    )
    # generation_seconds is rounded to the millisecond: tokens/s lies within that rounding.
    tokens, seconds = stats["completion_tokens"], stats["generation_seconds"]
    low, high = tokens / (seconds + 0.0006), tokens / max(seconds - 0.0006, 1e-9)
    assert low <= stats["output_tokens_per_second"] <= high


def write_part(path: Path, rows: list[dict[str, object]]) -> None:
    """A part with the output schema (no input columns) holding the given output rows."""
    path.mkdir(parents=True, exist_ok=True)
    schema = output_schema(pa.schema([]))
    output_rows = [OutputRow(**row) for row in rows]  # type: ignore[arg-type]
    table = build_table(schema, [], output_rows)  # with a job key: a part batchrun wrote
    table = table.replace_schema_metadata({b"batchrun.job": b"0" * 32})
    pq.write_table(table, path / "part-000000.parquet")


def test_stats_totals_do_not_wrap_past_2_to_the_31(tmp_path: Path) -> None:
    big = 2**31 - 10  # int32 in the part; three of them overflow an int32 sum
    rows = [
        {
            "row_index": i,
            "sample_index": 0,
            "completion": "x",
            "completion_token_ids": [1],
            "finish_reason": "length",
            "prompt_tokens": big,
            "completion_tokens": big,
            "spec_rounds": big // 2,
            "spec_accept_hist": [0, big // 2],
            "spec_capped_hist": [0, 0],
            "acceptance_length": 2.0,
            "error": None,
        }
        for i in range(3)
    ]
    write_part(tmp_path / "out", rows)
    result = invoke("stats", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert f"prompt tokens: {3 * big}, completion tokens: {3 * big}" in result.output
    assert f"{3 * (big // 2)} rounds, acceptance length (tau) 2.000" in result.output
    totals = StatsAccumulator()  # stats.json's totals, summed by pyarrow
    totals.add(pq.read_table(tmp_path / "out" / "part-000000.parquet"))
    assert (totals.prompt_tokens, totals.completion_tokens) == (3 * big, 3 * big)
    assert totals.spec_rounds == 3 * (big // 2) and totals.spec_tokens == 6 * (big // 2)


def test_run_help_states_every_default(tmp_path: Path) -> None:
    result = invoke("run", "--help")
    assert result.exit_code == 0
    job = JobSpec.from_keys({"input": "in", "output": "out", "target": "model"})
    for param in cli.commands["run"].params:
        if not isinstance(param, click.Option) or param.name == "help":
            continue
        # Flags of `run` only, and the off switch of prompt_logprobs, not job keys.
        if param.name in ("ray_address", "replicas", "no_prompt_logprobs"):
            assert param.help
            continue
        assert param.help and ("[default: " in param.help or "[required" in param.help), param.name
        default = job.value(str(param.name))
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert f"[default: {default}]" in param.help, param.name
    text = " ".join(result.output.split())  # click wraps long lines
    assert "--max-tokens INTEGER" in text and "[default: 256]" in text
    assert "--quiet" in text and "summary" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "many"], "'many' is not a valid integer"),
        (["--seed", str(2**64)], "job key 'seed'"),
        (["--stpo", "x"], "No such option '--stpo'"),
    ],
)
def test_a_bad_flag_is_one_line(
    tmp_path: Path, tiny_model: Path, flags: list[str], message: str
) -> None:
    write_prompts(tmp_path / "in", PROMPTS[:2])
    assert_one_line_error(invoke("run", str(write_job(tmp_path, tiny_model)), *flags), message)


def test_ignore_eos_generates_past_the_end(tmp_path: Path, tiny_model: Path) -> None:
    """A copy of the tiny model whose end-of-sequence id is the first token row 0 generates:
    there it stops at once; with ignore_eos (the job's, or the row's cell) every row writes the
    original model's tokens to max_tokens, with a draft alike."""
    write_prompts(tmp_path / "in", PROMPTS[:4])
    job = str(write_job(tmp_path, tiny_model, max_tokens=10))
    assert invoke("run", job, "--output", str(tmp_path / "plain")).exit_code == 0
    plain = read_output(tmp_path / "plain").column("completion_token_ids").to_pylist()
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = {"eos_token_id": plain[0][0]}
    (model / "generation_config.json").write_text(json.dumps(config))
    job = str(write_job(tmp_path, model, max_tokens=10))
    assert invoke("run", job, "--output", str(tmp_path / "stops")).exit_code == 0
    first = read_output(tmp_path / "stops").to_pylist()[0]
    assert (first["finish_reason"], first["completion_tokens"]) == ("stop", 1)
    draft = make_tiny_draft(tmp_path / "draft", model, block_size=4)
    for args in (["--ignore-eos"], ["--ignore-eos", "--draft", str(draft)]):
        out = str(tmp_path / "-".join(a.strip("-")[:5] for a in args))
        assert invoke("run", job, *args, "--output", out).exit_code == 0
        rows = read_output(Path(out)).to_pylist()
        assert [r["completion_token_ids"] for r in rows] == plain, args
        assert all(r["finish_reason"] == "length" for r in rows)
    # As a row's cell: true goes on, a non-boolean is the row's error.
    table = pa.table({"prompt": PROMPTS[:2], "ignore_eos": pa.array([True, None])})
    pq.write_table(table, tmp_path / "in" / "0.parquet")
    cells = pa.table({"prompt": PROMPTS[:1], "ignore_eos": pa.array(["yes"])})
    (tmp_path / "in2").mkdir()
    pq.write_table(cells, tmp_path / "in2" / "0.parquet")
    assert invoke("run", job, "--output", str(tmp_path / "cells")).exit_code == 0
    rows = read_output(tmp_path / "cells").to_pylist()
    assert rows[0]["completion_token_ids"] == plain[0] and rows[1]["finish_reason"] == "length"
    result = invoke("run", job, "--input", str(tmp_path / "in2"), "--output", str(tmp_path / "bad"))
    assert result.exit_code == 0, result.output
    assert read_output(tmp_path / "bad").column("error").to_pylist() == [
        "ignore_eos must be true or false, got 'yes'"
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["--presence-penalty", "2.5"], "job key 'presence_penalty': 2.5 is greater than"),
        (["--frequency-penalty", "nan"], "frequency_penalty must be a number in [-2, 2]"),
        (["--repetition-penalty", "0"], "job key 'repetition_penalty'"),
        (["--min-tokens", "7"], "min_tokens must be an integer in [0, max_tokens], got 7"),
        (["--min-p", "1.5"], "job key 'min_p': 1.5 is greater than"),
        ('logit_bias = {"x" = 1}\n', "job key 'logit_bias': 'x' does not match"),
        ('logit_bias = {"3" = 101}\n', "job key 'logit_bias': 101 is greater than"),
        ('logit_bias = {"3" = 1, "03" = 2}\n', "logit_bias names token id 3 twice"),
        ('logit_bias = {"99999" = 1}\n', "logit_bias token id 99999 is outside the vocabulary"),
    ],
)
def test_a_bad_control_refuses_the_job_in_one_line(
    tmp_path: Path, tiny_model: Path, settings: list[str] | str, message: str
) -> None:
    write_prompts(tmp_path / "in", PROMPTS[:2])
    extra = settings if isinstance(settings, str) else ""
    flags = settings if isinstance(settings, list) else []
    job = str(write_job(tmp_path, tiny_model, extra))
    for command in ("validate", "run"):
        assert_one_line_error(invoke(command, job, *flags), message)
    assert not (tmp_path / "out").exists()


def test_control_cells_run_or_are_their_rows_errors(tmp_path: Path, tiny_model: Path) -> None:
    """Valid cells change their rows as the job's keys would; a bad cell is its row's error."""
    cells = {
        "presence_penalty": [1.5, None, 3.0, None, None, None, None, None],
        "frequency_penalty": [None] * 8,
        "repetition_penalty": [None, 2.0, None, -1.0, None, None, None, None],
        "min_tokens": [None, None, None, None, 99, None, None, None],
        "logit_bias": [None, None, None, None, None, '{"5": 50}', '{"5": "x"}', "[1]"],
        "min_p": [None, None, None, None, None, None, None, 0.5],
    }
    prompts = [PROMPTS[0]] * 8
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": prompts, **cells}), tmp_path / "in" / "0.parquet")
    job = str(write_job(tmp_path, tiny_model))
    assert invoke("run", job).exit_code == 0
    rows = read_output(tmp_path / "out").to_pylist()
    assert [r["error"] for r in rows] == [
        None,
        None,
        "presence_penalty must be a number in [-2, 2], got 3.0",
        "repetition_penalty must be a finite number > 0, got -1.0",
        "min_tokens must be an integer in [0, max_tokens], got 99",
        None,
        "logit_bias values must be numbers, got 'x'",
        "logit_bias must be a JSON object, got [1]",
    ]
    for row, job_keys in ((0, ["--presence-penalty", "1.5"]), (1, ["--repetition-penalty", "2"])):
        out = str(tmp_path / f"job-{row}")
        plain_in = tmp_path / f"in-{row}"
        write_prompts(plain_in, PROMPTS[:1])
        assert (
            invoke("run", job, *job_keys, "--input", str(plain_in), "--output", out).exit_code == 0
        )
        by_job = read_output(Path(out)).column("completion_token_ids").to_pylist()[0]
        assert rows[row]["completion_token_ids"] == by_job
    assert rows[5]["completion_token_ids"] == [5] * 6
