"""A short version of the demo job: the shipped pair loads from the package, speculation keeps the
target's completions exactly, and the drafter really speculates."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from click.testing import CliRunner

from batchrun import demo
from batchrun.cli import cli

JOBS = Path(__file__).resolve().parents[2] / "jobs"
MAX_BYTES = 12 * 1000 * 1000


def run_demo(out: Path, *extra: str) -> dict:
    args = ["run", str(JOBS / "demo.toml"), "--output", str(out), "--max-tokens", "48", "--quiet"]
    result = CliRunner().invoke(cli, [*args, *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "stats.json").read_text())


def test_short_demo_job(tmp_path: Path) -> None:
    spec = run_demo(tmp_path / "spec", "--verify-width", "full")  # every round a full block
    plain = run_demo(tmp_path / "plain", "--draft", "none")
    adaptive = run_demo(tmp_path / "adaptive")  # the default: the width each step chooses
    assert adaptive["rows"] == adaptive["ok_rows"] == 48
    assert plain["acceptance_length"] is None
    assert spec["rows"] == spec["ok_rows"] == 48
    assert spec["block_size"] == 16
    assert spec["acceptance_length"] > 1.5  # measured 2.0 at 48 tokens; 3.1 at the job's 384

    def completions(out: Path) -> list:
        frame = pl.read_parquet(out / "*.parquet").sort("row_index")
        return frame["completion_token_ids"].to_list()

    assert completions(tmp_path / "spec") == completions(tmp_path / "plain")
    assert completions(tmp_path / "adaptive") == completions(tmp_path / "plain")


def test_demo_pair_fits_the_package_budget() -> None:
    files = [*demo.TARGET.iterdir(), *demo.DRAFT.iterdir()]
    assert sum(f.stat().st_size for f in files) <= MAX_BYTES
    config = json.loads((demo.DRAFT / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] >= 4096  # a padded row, no real token


def test_demo_json_job_writes_valid_json_with_and_without_the_drafter(tmp_path: Path) -> None:
    import jsonschema

    frames = {}
    for name, extra in (("spec", ["--verify-width", "full"]), ("plain", ["--draft", "none"])):
        out = tmp_path / name
        args = ["run", str(JOBS / "demo_json.toml"), "--output", str(out), "--quiet", *extra]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        frames[name] = pl.read_parquet(out / "*.parquet").sort("row_index")
    spec, plain = frames["spec"], frames["plain"]
    assert spec["completion_token_ids"].to_list() == plain["completion_token_ids"].to_list()
    for row in plain.to_dicts():
        assert row["finish_reason"] == "stop" and row["error"] is None
        jsonschema.validate(json.loads(row["completion"]), json.loads(row["json_schema"]))
