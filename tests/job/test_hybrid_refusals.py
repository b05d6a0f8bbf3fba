"""A broken hybrid (Qwen3.5) checkpoint is refused by `validate` and `run` alike: one line, exit 2,
before any weight loads (the config's keys and the checkpoint's tensor names are read first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from batchrun.tools.bpe import build_tokenizer
from tests.helpers.hybrid_models import VOCAB, make_hybrid, with_tokenizer
from tests.job.test_preflight import assert_refused_alike
from tests.job.test_validate_matches_run import base_flags


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(tokenizer, vocab_size=VOCAB, max_bytes=200_000)
    out = tmp_path_factory.mktemp("qwen3_5_text")
    make_hybrid(out, "qwen3_5_text")
    with_tokenizer(out, tokenizer)
    return out


def broken(src: Path, dst: Path, config: dict[str, object], drop: str | None = None) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    settings = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(settings | config))
    if drop is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


CASES = {
    "layer_types of the wrong length": (
        {"layer_types": ["linear_attention"] * 3},
        None,
        "layer_types has 3 entries",
    ),
    "key heads that do not divide the value heads": (
        {"linear_num_key_heads": 3},
        None,
        "linear_num_key_heads 3 does not divide",
    ),
    "a missing linear-attention tensor": (
        {},
        "model.layers.1.linear_attn.A_log",
        "model.layers.1.linear_attn.A_log",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_hybrid_is_refused_alike(
    hybrid: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    config, drop, message = CASES[case]
    model = broken(hybrid, tmp_path / "model", config, drop)
    assert_refused_alike(base_flags(tmp_path, model), message, tmp_path / "out", monkeypatch)


def test_a_sound_hybrid_validates(hybrid: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batchrun.cli import cli

    result = CliRunner().invoke(cli, ["validate", *base_flags(tmp_path, hybrid)])
    assert result.exit_code == 0, result.output
