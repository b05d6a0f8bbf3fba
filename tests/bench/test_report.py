"""Merged statistics (`batchrun stats` over every shard and run of a job) and `batchrun report`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner, Result

from batchrun.cli import cli
from batchrun.reporting.report import TITLES
from batchrun.tools.tiny_draft import make_tiny_draft

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [f"def step_{i}(state):" for i in range(10)] + ["", None, "import os"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def write_job(directory: Path, model: Path, max_batch_size: int = 4) -> Path:
    (directory / "in").mkdir(parents=True)
    table = pa.table(
        {"prompt": pa.array(PROMPTS, pa.string()), "number": list(range(len(PROMPTS)))}
    )
    # Row groups of 2 rows: every shard of a few gets some (shards take whole row groups).
    pq.write_table(table, directory / "in" / "prompts.parquet", row_group_size=2)
    job = directory / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{model}"\nquiet = true\n'
        f"max_tokens = 6\nrows_per_part = 2\nmax_batch_size = {max_batch_size}\n"
    )
    return job


def run(job: Path, *flags: str) -> None:
    result = invoke("run", str(job), *flags)
    assert result.exit_code == 0, result.output


def summary_lines(out: Path) -> list[str]:
    """`batchrun stats` without its first line (which names the directory and counts parts)."""
    result = invoke("stats", str(out))
    assert result.exit_code == 0, result.output
    return result.output.splitlines()[1:]


def drop_parts(out: Path, names: list[str]) -> None:
    """As if the run that wrote them had been killed before they were written."""
    for name in names:
        (out / name).unlink()
        (out / "_progress" / name.replace(".parquet", ".json")).unlink()
    (out / "_SUCCESS").unlink(missing_ok=True)


# -- merged statistics -------------------------------------------------------------------------


def test_stats_merge_shards_and_resumed_runs_counting_each_row_once(
    tmp_path: Path, tiny_model: Path
) -> None:
    # One request at a time: rows finish (and parts are written) one by one.
    run(write_job(tmp_path / "whole", tiny_model, max_batch_size=1))
    whole = summary_lines(tmp_path / "whole" / "out")
    assert whole[0] == "rows: 13 (11 ok, 2 errors)"

    job = write_job(tmp_path / "sharded", tiny_model, max_batch_size=1)
    out = tmp_path / "sharded" / "out"
    run(job, "--shard", "0/3")
    run(job, "--shard", "1/3")
    drop_parts(out, ["part-00001-of-00003-000001.parquet"])  # shard 1 killed before its last part
    run(job, "--shard", "1/3")  # resumed: redoes only that part's rows
    run(job, "--shard", "2/3")
    run(job)  # the whole job again: every row is done, nothing is written
    assert (out / "_SUCCESS").exists()
    assert summary_lines(out) == whole  # the same rows, tokens and errors as one run

    manifests = (out / "_progress").glob("part-00001-*.json")
    runs = {json.loads(m.read_text())["run_started"] for m in manifests}
    assert len(runs) == 2  # shard 1's parts come from two runs
    report = invoke("report", str(out))
    assert report.exit_code == 0, report.output
    assert "13 of 13 (complete)" in (out / "report.html").read_text()
    assert "from 3 shard(s) in 4 run(s)" in (out / "report.html").read_text()


def test_stats_leave_out_damaged_parts_and_parts_of_an_overwritten_job(
    tmp_path: Path, tiny_model: Path
) -> None:
    job = write_job(tmp_path, tiny_model)
    out = tmp_path / "out"
    run(job, "--shard", "0/2")
    run(job, "--shard", "1/2")
    # Shard 0 of another job overwrites shard 0's parts; shard 1's still hold the first job's.
    run(job, "--shard", "0/2", "--temperature", "0.8", "--overwrite")
    first_job_parts = len(list(out.glob("part-00001-of-00002-*")))
    lines = invoke("stats", str(out)).output.splitlines()
    assert lines[0].endswith(f"{first_job_parts} left out, not complete)")
    alone = write_job(tmp_path / "alone", tiny_model)  # the second job's shard 0 by itself
    run(alone, "--shard", "0/2", "--temperature", "0.8")
    assert lines[1:] == summary_lines(tmp_path / "alone" / "out")

    # A damaged part and a copy of a committed part (its rows twice) change nothing.
    (out / "part-00000-of-00002-000098.parquet").write_bytes(b"PAR1 not a parquet file")
    shutil.copy(
        out / "part-00000-of-00002-000000.parquet", out / "part-00000-of-00002-000099.parquet"
    )
    again = invoke("stats", str(out)).output.splitlines()
    assert again[0].endswith(f"{first_job_parts + 1} left out, not complete)")
    assert again[1:] == lines[1:]


# -- the report --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A finished job with a draft and error rows; its output directory."""
    directory = tmp_path_factory.mktemp("report")
    draft = make_tiny_draft(directory / "draft", tiny_model, block_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(write_job(directory, tiny_model), "--draft", str(draft), "--max-tokens", "12")
    finally:
        torch.set_num_threads(threads)
    return directory / "out"


def test_the_report_has_every_plot_and_needs_no_network(finished: Path) -> None:
    result = invoke("report", str(finished))
    assert result.exit_code == 0, result.output
    path = finished / "report.html"
    assert result.output == f"batchrun: report -> {path}\n"
    page = path.read_text()
    for div_id, title in TITLES.items():
        assert f"<h2>{title}</h2>" in page
        assert f'<div id="{div_id}" class="plotly-graph-div"' in page
    assert not re.search(r"<script[^>]*\bsrc=", page)  # plotly.js is inlined
    assert not re.search(r"<link[^>]*\bhref=", page)
    assert page.count("<script") >= 5 and len(page) > 1_000_000
    for cell in ("13 of 13 (complete)", "11 / 2", "prompt is empty", "prompt is null"):
        assert cell in page
    stats = json.loads((finished / "stats.json").read_text())
    assert f"<th>draft</th><td>{stats['draft']}</td>" in page
    for manifest in (finished / "_progress").glob("part-*.json"):  # throughput's times
        times = json.loads(manifest.read_text())
        assert times["run_started"] <= times["written"]


def test_a_report_without_a_draft_says_so(tmp_path: Path, tiny_model: Path) -> None:
    run(write_job(tmp_path, tiny_model))
    result = invoke("report", str(tmp_path / "out"), "--out", str(tmp_path / "r.html"))
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r.html").read_text()
    assert "No draft model: the speculation plots (tau, acceptance) are left out." in page
    assert 'id="tau"' not in page and 'id="acceptance"' not in page
    assert 'id="throughput"' in page and 'id="completion-length"' in page


def test_report_errors_are_one_line(
    tmp_path: Path, finished: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = invoke("report", str(tmp_path))
    assert missing.exit_code == 2 and missing.stderr.startswith("batchrun: error: no part files")
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if batchrun[report] were not installed
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    result = invoke("report", str(finished))
    assert result.exit_code == 2
    assert result.stderr == (
        "batchrun: error: batchrun report needs plotly: pip install 'batchrun[report]'\n"
    )


# -- a hostile output directory (more in test_output_dir_hostile.py) -----------------------------


def copy_of(out: Path, tmp_path: Path) -> Path:
    shutil.copytree(out, tmp_path / "out")
    return tmp_path / "out"


@pytest.mark.parametrize("job_record", [True, False], ids=["with-job-json", "without"])
def test_parts_batchrun_did_not_write_are_left_out_with_a_warning(
    tmp_path: Path, finished: Path, job_record: bool
) -> None:
    out = copy_of(finished, tmp_path)
    pq.write_table(pa.table({"x": [1, 2]}), out / "part-000098.parquet")  # unrelated columns
    (out / "part-000099.parquet").write_bytes(b"not a Parquet file")  # damaged: left out too
    if not job_record:
        (out / "_progress" / "job.json").unlink()
    warning = "batchrun: warning: 1 part file(s) not written by batchrun left out: "
    stats = invoke("stats", str(out))
    assert stats.exit_code == 0, stats.output
    assert stats.stderr == warning + "part-000098.parquet\n"
    lines = stats.stdout.splitlines()
    assert lines[0].endswith("2 left out, complete)") and lines[1:] == summary_lines(finished)
    report = invoke("report", str(out))
    assert report.exit_code == 0 and report.stderr == stats.stderr, report.output
    assert "13 of 13 (complete)" in (out / "report.html").read_text()


def test_parts_that_carry_the_job_key_but_not_its_columns(tmp_path: Path, finished: Path) -> None:
    """Forged parts: without an int64 row_index one is damaged (left out, as `run` moves it
    aside); with batchrun's columns of other types, stats and report stop in one line."""
    out = copy_of(finished, tmp_path)
    real = pq.read_table(out / "part-000000.parquet")
    key = real.schema.metadata
    pq.write_table(pa.table({"x": [1]}).replace_schema_metadata(key), out / "part-000098.parquet")
    lines = invoke("stats", str(out)).stdout.splitlines()
    assert lines[0].endswith("1 left out, complete)") and lines[1:] == summary_lines(finished)
    tokens = real.column("prompt_tokens").cast(pa.string())
    forged = real.set_column(real.schema.get_field_index("prompt_tokens"), "prompt_tokens", tokens)
    pq.write_table(forged.replace_schema_metadata(key), out / "part-000099.parquet")
    for command in ("stats", "report"):
        result = invoke(command, str(out))
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("batchrun: error: cannot read the parts of")
        assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [("run_started", "x"), ("written", [1]), ("written", 1e300), ("rows", "3"), (None, [1, 2])],
)
def test_a_manifest_of_the_wrong_types_counts_as_absent(
    tmp_path: Path, finished: Path, field: str | None, value: object
) -> None:
    """As `stats` does: the part is the truth; its time falls back to the file's mtime."""
    out = copy_of(finished, tmp_path)
    for manifest in (out / "_progress").glob("part-*.json"):
        data = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**data, field: value} if field else value))
    for command in ("stats", "report"):
        result = invoke(command, str(out))
        assert result.exit_code == 0 and not result.stderr, result.output
    assert summary_lines(out) == summary_lines(finished)
    assert "13 of 13 (complete)" in (out / "report.html").read_text()


def _chromium() -> str | None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from report_screenshot import find_chromium
    finally:
        sys.path.pop(0)
    return find_chromium()


def test_the_report_opens_in_a_headless_browser(tmp_path: Path, finished: Path) -> None:
    pytest.importorskip("playwright")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium (apt-get install chromium, or python -m playwright install)")
    report = tmp_path / "report.html"
    assert invoke("report", str(finished), "--out", str(report)).exit_code == 0
    shot = tmp_path / "report.png"
    checked = subprocess.run(
        [sys.executable, str(REPO / "bench" / "report_screenshot.py"), str(report), str(shot)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stderr  # no console or page error, every plot drawn
    assert shot.read_bytes().startswith(b"\x89PNG")
