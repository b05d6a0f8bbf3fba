"""Loading hybrid targets: the family declaration reads each model_type, a multimodal
checkpoint's vision tower and MTP weights are skipped and said so, and bad inputs are refused
in one line before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchrun.errors import JobError
from batchrun.models.loader import (
    iter_safetensors,
    load_qwen3,
    qwen3_shape,
    read_config,
    target_weights,
)
from batchrun.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5Shape
from tests.helpers.hybrid_models import make_hybrid

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_5")
    make_hybrid(out, "qwen3_5")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)  # as published checkpoints carry
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_5_text")
    make_hybrid(out, "qwen3_5_text")
    return out


def test_the_vision_tower_and_mtp_are_skipped_and_reported(multimodal: Path) -> None:
    config = read_config(multimodal)
    shape = qwen3_shape(config)
    assert isinstance(shape, Qwen3_5Shape)
    assert shape.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert shape.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    model = Qwen3_5ForCausalLM(shape)
    tensors, skipped = target_weights(iter_safetensors(multimodal), config, shape, model)
    names = [name for name, _ in tensors]
    assert not any(n.startswith(("model.visual.", "mtp.", "model.language_model.")) for n in names)
    assert sorted(skipped) == ["the MTP head", "the vision tower"]
    loaded, _ = load_qwen3(multimodal, "float32", CPU)
    assert isinstance(loaded, Qwen3_5ForCausalLM)


def edited(src: Path, dst: Path, change: dict[str, object]) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(change)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "layer_types holds 'sliding'"),
        ({"linear_num_key_heads": 3}, "linear_num_key_heads 3 does not divide"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide"),
        ({"linear_conv_kernel_dim": "4"}, "linear_conv_kernel_dim must be an integer"),
        ({"model_type": "qwen3_vl"}, "model_type is 'qwen3_vl'; batchrun runs"),
    ],
)
def test_bad_configs_are_refused_in_one_line(
    text: Path, tmp_path: Path, change: dict[str, object], message: str
) -> None:
    with pytest.raises(JobError) as error:
        load_qwen3(edited(text, tmp_path / "m", change), "float32", CPU)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_missing_linear_attention_weights_are_refused_in_one_line(
    text: Path, tmp_path: Path
) -> None:
    target = edited(text, tmp_path / "m", {})
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(JobError, match=r"lacks 'model\.layers\.1\.linear_attn\.A_log'"):
        load_qwen3(target, "float32", CPU)
