"""`batchrun bench` runs end to end on a tiny pair and reports comparable results (no timings
are checked: speed lives in the benchmark's JSON, not in tests)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.tools.tiny_draft import make_tiny_draft


def test_bench_writes_result_json(tiny_model: Path, tmp_path: Path) -> None:
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4)
    out = tmp_path / "bench.json"
    args = ["bench", "--target", str(tiny_model), "--draft", str(draft), "--device", "cpu"]
    args += ["--num-prompts", "3", "--prompt-len", "8", "--max-tokens", "6", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"target_only", "speculative", "hf_generate"}
    assert data["ratios"]["speculative_outputs_identical"] is True
    target_only = data["results"]["target_only"]
    assert target_only["output_tokens"] == 18  # the random tiny model emits no eos this early
    assert data["results"]["speculative"]["acceptance_length"] >= 1.0
    assert data["setup"]["device"] == "cpu"
