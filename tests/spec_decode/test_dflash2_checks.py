"""A DFlash2 draft's start-up checks: `auto` chooses the method by the config's architectures,
validate describes the draft, and a bad DFlash2 draft is refused in one line (exit 2) alike by
validate and run, before any weight is loaded."""

from __future__ import annotations

import json
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


def test_the_published_config_layout_is_accepted(tmp_path: Path, tiny_model: Path) -> None:
    """z-lab's published DFlash2 config.json (z-lab/dflash tests/fixtures/dflash2-config.json:
    transformers 5's rope_parameters, every layer sliding over 2048 positions, non-causal, the
    softcapping and output multiplier), its widths and ids scaled to the tiny target."""
    draft = make_tiny_dflash2(tmp_path / "draft", tiny_model, num_layers=2, target_layer_ids=[0, 1])
    target = json.loads((tiny_model / "config.json").read_text())
    config = json.loads((draft / "config.json").read_text())
    published = {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "is_causal": False,
        "dflash_config": {
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": config["dflash_config"]["mask_token_id"],
            "output_multiplier": 0.19611613513818404,
            "selector_rank": 8,
            "selector_top_k": 4,
            "target_layer_ids": [0, 1],
        },
        "dtype": "float32",
        "head_dim": config["head_dim"],
        "hidden_act": "silu",
        "hidden_size": config["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": config["intermediate_size"],
        "layer_types": ["sliding_attention", "sliding_attention"],
        "max_position_embeddings": 131072,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": config["num_attention_heads"],
        "num_hidden_layers": 2,
        "num_key_value_heads": config["num_key_value_heads"],
        "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "tie_word_embeddings": False,
        "transformers_version": "5.15.0",
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": config["vocab_size"],
    }
    (draft / "config.json").write_text(json.dumps(published))
    checked = check_draft(draft, "auto", qwen3_shape(read_config(tiny_model)))
    spec = checked.spec
    assert checked.method.name == "dflash2" and spec.dflash.block_size == 16
    assert spec.dflash.attention.sliding == (True, True) and spec.dflash.attention.window == 2048
    assert not spec.dflash.attention.sliding_causal
    assert (spec.softcapping, spec.output_multiplier) == (20.0, 0.19611613513818404)
    assert spec.dflash.shape.rope_theta == 500000.0
    assert checked.layout.ring_layers == 2 and checked.layout.paged_layers == 0
