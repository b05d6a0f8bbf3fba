"""Three shard runs at once on one output directory, killed with SIGKILL at random moments and
resubmitted, five rounds.

Each run takes shard 0/2 or 1/2 at random (whole row groups of a two-file input), so shards run
side by side, a second run of a shard is refused, and a killed shard is resubmitted. It opens
with one refusal that does not depend on timing: a run of shard 0 frozen while it holds its
claim, a second run of that shard, then the first killed. At the end
every input row is there exactly once, with the completions of an uninterrupted unsharded run;
along the way no run exits 0 unless its shard's rows were all committed, with no row twice,
right then.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchrun.io.input.reader import open_input
from batchrun.io.input.shards import shard_rows
from tests.io.test_output_safety import (
    assert_complete,
    claim_files,
    committed_rows,
    kill,
    read_output,
    run_process,
    start,
    start_stopped_holder,
    write_job,
    write_prompts,
)

ROWS = 80
ROUNDS = 5
RUNS_PER_ROUND = 3
SHARDS = ("0/2", "1/2")
SEED = 20240607


@dataclass
class Launch:
    shard: str
    start_at: float  # seconds into the round
    kill_after_seconds: float | None  # SIGKILL this long after its start (during start-up)
    kill_after_parts: int | None  # or once this many more parts are committed (mid-job)
    process: subprocess.Popen[str] | None = None
    started: float = 0.0
    parts_at_start: int = 0

    def due(self, parts: int) -> bool:
        if self.kill_after_seconds is not None:
            return time.monotonic() - self.started >= self.kill_after_seconds
        return self.kill_after_parts is not None and parts - self.parts_at_start >= (
            self.kill_after_parts
        )


def random_launch(rng: random.Random) -> Launch:
    # Starts within 3 s of each other: a run takes about that to reach its claim, so runs of one
    # shard meet often enough for the test to see a refusal.
    shard, start_at, kind = rng.choice(SHARDS), rng.uniform(0.0, 3.0), rng.random()
    if kind < 0.3:
        return Launch(shard, start_at, rng.uniform(0.2, 10.0), None)
    if kind < 0.85:
        return Launch(shard, start_at, None, rng.randint(2, 10))
    return Launch(shard, start_at, None, None)  # runs to its end


def assert_shard_done(out: Path, rows: range) -> None:
    """Every row of the shard committed, and no row of the output twice."""
    committed = committed_rows(out)
    assert len(committed) == len(set(committed)), "a row was committed twice"
    assert set(rows) <= set(committed)


def run_round(
    rng: random.Random, job: Path, out: Path, ranges: dict[str, range]
) -> list[tuple[int, str]]:
    """Start RUNS_PER_ROUND shard runs at random offsets and kill most at random moments;
    returns each run's (exit code, stderr). Checks the output the moment a run exits 0."""
    pending = [random_launch(rng) for _ in range(RUNS_PER_ROUND)]
    results: list[tuple[int, str]] = []
    began = time.monotonic()
    while pending:
        parts = len(list(out.glob("part-*.parquet")))
        for launch in pending:
            if launch.process is None:
                if time.monotonic() - began >= launch.start_at:
                    launch.process = start(job, "--shard", launch.shard)
                    launch.started = time.monotonic()
                    launch.parts_at_start = parts
                continue
            if launch.process.poll() is None:
                if launch.due(parts):
                    os.kill(launch.process.pid, signal.SIGKILL)
                continue
            if launch.process.returncode == 0:  # its rows exactly once, at this moment
                assert_shard_done(out, ranges[launch.shard])
            _, stderr = launch.process.communicate()
            results.append((launch.process.returncode, stderr))
            pending.remove(launch)
            break
        time.sleep(0.002)
    return results


@pytest.mark.slow
def test_concurrent_runs_killed_at_random_never_lose_or_duplicate_a_row(
    tmp_path: Path, tiny_model: Path
) -> None:
    rng = random.Random(SEED)
    prompts = [f"def task_{i}(queue, item):" for i in range(ROWS)]
    half = ROWS // 2 + 3  # two files, row groups of 10 rows and the ends of the files
    write_prompts(tmp_path / "in", prompts[:half], "a.parquet", row_group_size=10)
    write_prompts(tmp_path / "in", prompts[half:], "b.parquet", row_group_size=10)
    source = open_input(str(tmp_path / "in"))
    ranges = {shard: shard_rows(source, (int(shard[0]), 2)) for shard in SHARDS}
    assert ranges == {"0/2": range(0, 40), "1/2": range(40, 80)}
    job = write_job(tmp_path, tiny_model, max_tokens=16, rows_per_part=3, max_batch_size=2)
    out = tmp_path / "out"
    reference = run_process(job, "--output", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr

    holder = start_stopped_holder(job, out, "--shard", SHARDS[0])  # alive, its claim live
    refused = run_process(job, "--shard", SHARDS[0])
    kill(holder)
    assert (refused.returncode, holder.returncode) == (2, -signal.SIGKILL), refused.stderr
    assert "is being written by" in refused.stderr
    for _ in range(ROUNDS):
        for returncode, stderr in run_round(rng, job, out, ranges):
            assert returncode in (0, 2, -signal.SIGKILL), stderr
            if returncode == 2:  # lost the race for the claim
                assert len(stderr.splitlines()) == 1 and "is being written by" in stderr, stderr
        rows = committed_rows(out)
        assert len(rows) == len(set(rows)), "a row was committed twice"

    for shard in SHARDS:  # resubmitted: each shard finishes what its killed runs left
        final = run_process(job, "--shard", shard)
        assert final.returncode == 0, final.stderr
    assert_complete(out, ROWS)
    assert not claim_files(out)  # killed runs' claims were taken over, the rest released
    resumed, expected = read_output(out), read_output(tmp_path / "reference")
    for column in ("row_index", "completion", "completion_token_ids", "finish_reason"):
        assert resumed.column(column).equals(expected.column(column)), column
