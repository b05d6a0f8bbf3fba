"""The command line fuzzed: every command given hostile values for its flags ends in one line and
exit 2 (or runs, exit 0), never a traceback. `validate` stands in for `run` (it makes every
start-up check `run` makes); `stats` and `report` get hostile directories too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from tests.job.test_cli import write_job, write_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

HOSTILE = [
    "-1",
    "0",
    "-0",
    "1e309",
    "nan",
    "inf",
    "-inf",
    "2147483648",
    str(2**64),
    str(-(2**63) - 1),
    "10" * 40,
    "",
    " ",
    "x",
    "1,2",
    "0.5",
    "None",
    "true",
    "\x00",
    "é" * 300,
    "a" * 5000,
    "/",
    "/dev/null",
    "/nonexistent/dir",
    "../" * 64,
    "auto",
    "full",
]
FLAGS = [
    "--max-tokens",
    "--temperature",
    "--top-p",
    "--top-k",
    "--seed",
    "--n",
    "--logprobs",
    "--prompt-logprobs",
    "--max-batch-size",
    "--max-batched-tokens",
    "--schedule-window",
    "--gpu-memory-fraction",
    "--rows-per-part",
    "--part-seconds",
    "--verify-width",
    "--dtype",
    "--device",
    "--attention-backend",
    "--shard",
    "--tp",
    "--stop",
    "--stop-token-ids",
    "--output",
    "--input",
    "--target",
    "--draft",
    "--prompt-column",
    "--id-column",
]


def test_validate_with_hostile_flag_values_is_one_line_or_ok(
    tmp_path: Path, tiny_model: Path
) -> None:
    write_prompts(tmp_path / "in", ["def f(x):", "import os"])
    job = str(write_job(tmp_path, tiny_model))
    rng = random.Random(0)
    runner = CliRunner()
    for _ in range(120):
        flags = rng.sample(FLAGS, rng.randint(1, 3))
        args = [part for flag in flags for part in (flag, rng.choice(HOSTILE))]
        result = runner.invoke(cli, ["validate", job, *args])
        context = (args, result.output[-2000:])
        assert result.exit_code in (0, 2), context
        assert result.exception is None or isinstance(result.exception, SystemExit), context
        if result.exit_code == 2:
            assert len(result.output.strip().splitlines()) == 1, context


@pytest.mark.parametrize("command", ["stats", "report"])
def test_stats_and_report_on_hostile_paths(tmp_path: Path, command: str) -> None:
    (tmp_path / "file").write_text("x")
    # (No NUL byte: a command line cannot hold one.)
    for path in ["", "/nonexistent", str(tmp_path / "file"), "a" * 5000, "/dev/null"]:
        result = CliRunner().invoke(cli, [command, path])
        assert result.exit_code == 2, (path, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), path
        assert len(result.output.strip().splitlines()) == 1, (path, result.output)
