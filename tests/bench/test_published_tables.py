"""The published benchmark tables are what `python -m batchrun.bench.tables` renders from the
result files `bench/published.toml` names: every run of a file shown, a file without provenance
marked historical at the commit that added it, one with provenance naming its commit."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from batchrun.bench.table_kinds import MISSING, jobs, policy, steady
from batchrun.bench.tables import MANIFEST, Table, load_manifest, main, render, source, update

REPO = Path(__file__).resolve().parents[2]


def test_published_blocks_equal_what_their_files_give_now() -> None:
    stale, errors = update(REPO, check=True)
    assert errors == [] and stale == [], "run python -m batchrun.bench.tables\n" + "\n".join(
        errors + stale
    )


def test_the_render_needs_no_git(monkeypatch: pytest.MonkeyPatch) -> None:
    """The captions come from the files and the manifest alone, so a checkout without git (or
    an export without history) renders the same blocks."""
    monkeypatch.setenv("PATH", "")
    assert update(REPO, check=True) == ([], [])


def test_every_manifest_file_exists_and_every_historical_one_has_its_commit() -> None:
    tables, added_in = load_manifest(REPO)
    assert tables
    for table in tables:
        assert table.sources(), table.name
        for path in table.sources():
            assert (REPO / path).is_file(), f"{table.name}: {path}"
            if "provenance" not in json.loads((REPO / path).read_text()):
                assert path in added_in, f"{MANIFEST} [added_in] lacks {path}"
    for path in added_in:
        assert (REPO / path).is_file(), path


def test_added_in_is_the_commit_that_added_each_file() -> None:
    """Checked against git only where this is a git checkout (the render never asks git)."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout")
    _, added_in = load_manifest(REPO)
    for path, commit in added_in.items():
        log = ["log", "--diff-filter=A", "--format=%H", "--", path]
        done = subprocess.run([git, *log], cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0 or not done.stdout.strip():
            continue  # a shallow clone or an uncommitted file: nothing to compare with
        added = done.stdout.split()
        assert any(h.startswith(commit) for h in added), f"{path}: {commit} vs {added}"


def _run(tps: float, bound: float | None = None) -> dict[str, Any]:
    return {"tokens_per_second": tps} | ({"fraction_of_bound": bound} if bound else {})


def test_a_jobs_table_shows_every_run_in_its_file(tmp_path: Path) -> None:
    runs = {
        "none": _run(1000.0, 0.5),
        "useless auto": _run(900.0),
        "oracle tau 3 auto": _run(1500.0),
        "useless full": _run(250.0),  # the bad runs too
    }
    result = {
        "workloads": {
            "w1": {"runs": runs},
            "b1": {"runs": {"none": _run(100.0, 0.25), "oracle tau 9 full": _run(300.0)}},
        },
        "args": ["batchrun", "bench", "--jobs", "w1,b1"],
    }
    path = tmp_path / "bench/results/jobs.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))
    table = Table(name="t", page="p.md", kind="jobs", files=["bench/results/jobs.json"])
    text = render(table, {"bench/results/jobs.json": "abc1234"}, tmp_path)
    header, _, w1, b1 = text.splitlines()[:4]
    for name in [*runs, "oracle tau 9 full"]:
        assert f"`{name}`" in header
    assert w1 == "| w1 | 1,000 (50%) | 0.90x | 1.50x | 0.25x | — |"
    assert b1 == "| b1 | 100 (25%) | — | — | — | 3.00x |"
    assert "**historical**" in text and "`abc1234`" in text
    assert "`batchrun bench --jobs w1,b1`" in text


def test_a_policy_table_holds_auto_to_the_better_of_none_and_full() -> None:
    """One row per drafter scenario run under both auto and full; a scenario only one ran is
    left out, and a share under the contract says it missed."""
    runs = {
        "none": _run(1000.0),
        "useless auto": _run(960.0),  # 0.96 of none, which beats full
        "useless full": _run(300.0),
        "oracle tau 6.5 auto": _run(1700.0),
        "oracle tau 6.5 full": _run(1750.0),  # 1700 / 1750 = 0.971
        "collapse auto": _run(1100.0),  # no full run: no row
    }
    lines = policy({"f.json": {"workloads": {"w2": {"runs": runs}}}})
    assert lines[2:] == [
        "| w2 | useless | 1,000 | 0.960 | 0.300 | 0.960 (missed) |",
        "| w2 | oracle tau 6.5 | 1,000 | 1.700 | 1.750 | 0.971 |",
    ]


def test_a_file_without_provenance_is_historical_one_with_it_names_its_commit() -> None:
    old = source("bench/results/a.json", {"args": ["batchrun", "bench"]}, "abc1234")
    assert "**historical**" in old and "at or before `abc1234`" in old
    assert "`batchrun bench`" in old
    unknown = source("bench/results/a.json", {}, None)
    assert "**historical**" in unknown and "not committed" in unknown
    origin = {"commit": "def5678", "dirty": True, "device": {"name": "NVIDIA H200"}}
    origin |= {"command": "batchrun bench --jobs w1", "time_utc": "2026-12-05T02:45:00+00:00"}
    new = source("bench/results/b.json", {"provenance": origin}, "abc1234")
    assert "historical" not in new and "abc1234" not in new
    assert "commit `def5678`, dirty tree, NVIDIA H200" in new
    assert "`batchrun bench --jobs w1`" in new
    clean = source("bench/results/b.json", {"provenance": origin | {"dirty": False}}, None)
    assert "dirty" not in clean


def test_a_steady_table_shows_every_point_of_every_series() -> None:
    def row(batch: int, ms: float) -> dict[str, Any]:
        return {
            "batch": batch,
            "context": 1024,
            "target_only_ms_per_token_step": ms,
            "fraction_of_memory_roofline": 0.5,
        }

    result = {"summary_by_backend": {"triton": [row(1, 5.0), row(128, 10.0)], "b": [row(8, 6.0)]}}
    lines = steady({"x.json": result})
    assert lines[0].startswith("| series | batch, context |")
    assert lines[2:] == [
        "| triton | 1, 1,024 | 5.00 | 0.50 |",
        "| triton | 128, 1,024 | 10.00 | 0.50 |",
        "| b | 8, 1,024 | 6.00 | 0.50 |",
    ]
    assert len(jobs({"y.json": {"workloads": {}}})) == 2  # an empty file: a header, no rows


def test_a_hybrid_sweep_shows_its_rollback_as_a_share_of_each_round() -> None:
    rollback = {"rollback_share_by_width": {"2": 0.031, "16": 0.0121}}
    summary = [
        {"batch": 1, "context": 1024, "target_only_ms_per_token_step": 9.0} | rollback,
        {"batch": 32, "context": 1024, "target_only_ms_per_token_step": 12.0},  # none timed
    ]
    lines = steady({"x.json": {"summary": summary}})
    assert lines[0].endswith("| rollback, % of a round at W = 2 / 16 |")
    assert lines[2].endswith("| 3.1 / 1.2 |") and lines[3].endswith(f"| {MISSING} / {MISSING} |")


def test_check_reports_a_stale_block_and_the_rewrite_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = {"workloads": {"w1": {"runs": {"none": _run(1000.0, 0.5)}}}}
    (tmp_path / "bench").mkdir()
    (tmp_path / "r.json").write_text(json.dumps(result | {"provenance": {"commit": "abc"}}))
    (tmp_path / MANIFEST).write_text(
        '[[table]]\nname = "t"\npage = "p.md"\nkind = "jobs"\nfiles = ["r.json"]\n'
    )
    page = tmp_path / "p.md"
    page.write_text(
        "before\n<!-- table: t (generated) -->\n| w1 | 999 |\n<!-- /table: t -->\nafter\n"
    )
    stale, errors = update(tmp_path, check=True)
    assert errors == [] and stale == [
        "p.md: table t is stale (5 lines differ; line 1: '| w1 | 999 |' -> '| workload |"
        " `none`: tok/s (of its bound) |')"
    ]
    assert update(tmp_path) == (stale, [])
    assert update(tmp_path, check=True) == ([], [])
    text = page.read_text()
    assert text.startswith("before\n<!-- table: t (generated) -->\n| workload |")
    assert "| w1 | 1,000 (50%) |" in text and text.endswith("<!-- /table: t -->\nafter\n")
    assert main(["--check"]) == 0  # the repository's own pages
    capsys.readouterr()
