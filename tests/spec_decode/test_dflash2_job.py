"""Whole `batchrun run` jobs with a DFlash2 drafter, under the full block and the adaptive
width, with DFlash's speculation columns and statistics (per-position acceptance, tau)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dflash2_models import make_tiny_dflash2
from tests.job.test_cli import PROMPTS, invoke, read_output, write_job, write_prompts


@pytest.mark.parametrize(
    "sampling", ["", "temperature = 0.8\nseed = 7\n"], ids=["greedy", "seeded"]
)
def test_a_dflash2_job(tmp_path: Path, tiny_model: Path, sampling: str) -> None:
    """Greedy: the target's own completions. Seeded: sampled drafts verified against the walk's
    q, so the target's distribution (not necessarily its tokens), reproduced run to run."""
    draft = make_tiny_dflash2(tmp_path / "draft", tiny_model, target_layer_ids=[0, 1])
    write_prompts(tmp_path / "in", PROMPTS[:6])
    job = str(write_job(tmp_path, tiny_model, extra=sampling, max_tokens=12))
    assert invoke("run", job, "--output", str(tmp_path / "plain")).exit_code == 0
    result = invoke("run", job, "--draft", str(draft), "--verify-width", "full")
    assert result.exit_code == 0, result.output
    speculative, plain = read_output(tmp_path / "out"), read_output(tmp_path / "plain")
    ids = speculative.column("completion_token_ids")
    if not sampling:
        assert ids.equals(plain.column("completion_token_ids"))
    for row in speculative.to_pylist():
        hist = row["spec_accept_hist"]
        assert len(hist) == 4 and sum(hist) == row["spec_rounds"]
        assert row["completion_tokens"] == 1 + sum(k * hist[k - 1] for k in range(1, 5))
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["block_size"] == 4 and stats["spec_rounds"] > 0
    assert stats["acceptance_length"] >= 1 and len(stats["per_position_acceptance"]) == 3
    again = ["--draft", str(draft), "--verify-width", "full", "--output", str(tmp_path / "again")]
    assert invoke("run", job, *again).exit_code == 0
    assert read_output(tmp_path / "again").column("completion_token_ids").equals(ids)
    result = invoke("run", job, "--draft", str(draft), "--output", str(tmp_path / "auto"))
    assert result.exit_code == 0, result.output
    assert (
        json.loads((tmp_path / "auto" / "stats.json").read_text())["tokens_per_target_forward"] >= 1
    )
    if not sampling:
        auto = read_output(tmp_path / "auto").column("completion_token_ids")
        assert auto.equals(plain.column("completion_token_ids"))
