"""A DFlash2 draft's start-up checks: `auto` chooses the method by the config's architectures,
validate describes the draft, and a bad DFlash2 draft is refused in one line (exit 2) alike by
validate and run, before any weight is loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.spec_decode.registry import check_draft
from tests.helpers.dflash2_models import make_tiny_dflash2
from tests.job.test_preflight import assert_refused_alike, write_input

MakeDraft = Callable[[Path, Path], Path]


def flags(tmp_path: Path, target: Path, draft: Path) -> list[str]:
    write_input(tmp_path / "in")
    out = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    return [*out, "--target", str(target), "--draft", str(draft)]


def test_auto_chooses_dflash2_and_validate_describes_it(tmp_path: Path, tiny_model: Path) -> None:
    draft = make_tiny_dflash2(tmp_path / "draft", tiny_model, target_layer_ids=[0, 1])
    checked = check_draft(draft, "auto", qwen3_shape(read_config(tiny_model)))
    assert checked.method.name == "dflash2"
    assert checked.layout.block_size == 4 and checked.layout.feature_layers == 2
    result = CliRunner().invoke(cli, ["validate", *flags(tmp_path, tiny_model, draft)])
    assert result.exit_code == 0, result.output
    assert "(z-lab format, 2 layers, block size 4, target layers [0, 1]" in result.output
    assert "convolutions over groups of 16 channels, selector rank 8 over the top 4" in (
        result.output
    )
    assert result.output.endswith("ok\n")


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "missing-selector": (
        {"drop": ("candidate_selector.successor_codebook",)},
        "candidate_selector.successor_codebook is missing",
    ),
    "missing-projection": (
        {"drop": ("candidate_selector.hidden_projection.weight",)},
        "candidate_selector.hidden_projection.weight is missing",
    ),
    "top-k-over-vocabulary": (
        {"keys": {"selector_top_k": 5000}},
        "selector_top_k 5000 is larger than the vocabulary",
    ),
    "conv-kernel-size": (
        {"keys": {"conv_kernel_size": 3}},
        "conv_kernel_size 3 is not supported (batchrun implements 2)",
    ),
    "conv-group": ({"keys": {"conv_group_size": 48}}, "conv_group_size 48 does not divide"),
    "no-rank": ({"keys": {"selector_rank": 0}}, "selector_rank must be"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dflash2_draft_refused_alike(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    change, message = BAD[case]
    draft = make_tiny_dflash2(tmp_path / "draft", tiny_model, **change)
    assert_refused_alike(flags(tmp_path, tiny_model, draft), message, tmp_path / "out", monkeypatch)
