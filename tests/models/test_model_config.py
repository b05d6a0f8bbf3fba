"""Model configs (issue 32, items 2, 5 and 6): every key batchrun reads from a config.json is
checked by type and range before anything is built from it, so `validate` and `run` refuse a
malformed one in the same one line (exit 2) naming the file and the key; a key left out means
what it means to transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import CONFIG_MAPPING

from batchrun.models.config_check import TABLES, checked_config
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.job.test_preflight import assert_refused_alike, config_only_copy, write_input

pytestmark = pytest.mark.usefixtures("one_thread")

Edit = Callable[[dict[str, Any]], Any]
DROP = object()  # an edit's value: leave the key out


def keys(**values: Any) -> Edit:
    """Set (or, with DROP, remove) top-level keys."""

    def edit(config: dict[str, Any]) -> None:
        for key, value in values.items():
            if value is DROP:
                config.pop(key, None)
            else:
                config[key] = value

    return edit


@pytest.fixture(scope="module")
def moe_model(make_model: Callable[..., Path]) -> Path:
    return make_model(
        num_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=(1,),
        tie_word_embeddings=False,
    )


def assert_target_refused(
    model: Path, edit: Edit, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """validate and run refuse the model with its config.json edited in one same line that
    names the file and then says `says` (which begins with the key); returns the line."""
    copy = config_only_copy(model, tmp_path / "target")
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return refused_naming(
        ["--target", str(copy)], copy / "config.json", says, tmp_path, monkeypatch
    )


def refused_naming(
    flags: list[str], file: Path, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    write_input(tmp_path / "in")
    base = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    return assert_refused_alike([*base, *flags], f"{file}: {says}", tmp_path / "out", monkeypatch)


# -- item 5: malformed configs are one line, exit 2, naming the file and the key -----------

MOE_COUNTS = {
    "experts-null": (keys(num_local_experts=None), "num_local_experts must be an integer"),
    "experts-string": (keys(num_local_experts="4"), "num_local_experts must be an integer"),
    "experts-bool": (keys(num_local_experts=True), "num_local_experts must be an integer"),
    "experts-old-name-null": (
        keys(num_local_experts=DROP, num_experts=None),
        "num_experts must be an integer",
    ),
    "kv-heads-null": (keys(num_key_value_heads=None), "num_key_value_heads must be an integer"),
    "experts-per-token-zero": (keys(num_experts_per_tok=0), "num_experts_per_tok must be"),
    "experts-per-token-above-experts": (
        keys(num_experts_per_tok=5),
        r"num_experts_per_tok must be in [1, num_experts = 4], got 5",
    ),
    "sparse-step-zero": (keys(decoder_sparse_step=0), "decoder_sparse_step must be an integer"),
    "sparse-step-fraction": (keys(decoder_sparse_step=1.5), "decoder_sparse_step must be"),
    "expert-size-negative": (keys(moe_intermediate_size=-1), "moe_intermediate_size must be"),
    "renormalise-string": (keys(norm_topk_prob="true"), "norm_topk_prob must be true or false"),
}


@pytest.mark.parametrize("case", list(MOE_COUNTS))
def test_a_bad_expert_setting_is_one_line(
    moe_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    edit, says = MOE_COUNTS[case]
    assert_target_refused(moe_model, edit, says, tmp_path, monkeypatch)


LAYER_LISTS = {
    "strings": ["a"],
    "an-int": 1,
    "fractions": [1.5],
    "negative": [-1],
    "past-the-last-layer": [3],
}


@pytest.mark.parametrize("case", list(LAYER_LISTS))
def test_mlp_only_layers_must_be_layers(
    moe_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    edit = keys(mlp_only_layers=LAYER_LISTS[case])
    line = assert_target_refused(moe_model, edit, "mlp_only_layers ", tmp_path, monkeypatch)
    assert json.dumps(LAYER_LISTS[case]) in line or "names layer 3" in line


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def yarn(**change: Any) -> Edit:
    params = {**YARN, "rope_theta": 1e4, **change}
    return keys(rope_parameters={k: v for k, v in params.items() if v is not DROP})


YARN_CASES = {
    "factor-huge": (yarn(factor=1e308), "rope_parameters.factor 1e+308 x original"),
    "factor-string": (yarn(factor="4"), "rope_parameters.factor must be a finite number >= 1"),
    "factor-negative": (yarn(factor=-2), "rope_parameters.factor must be"),
    "factor-missing": (yarn(factor=DROP), "yarn needs factor in rope_parameters"),
    "original-string": (
        yarn(original_max_position_embeddings="128"),
        "rope_parameters.original_max_position_embeddings must be an integer",
    ),
    "original-missing": (
        yarn(original_max_position_embeddings=DROP),
        "yarn needs original_max_position_embeddings in rope_parameters",
    ),
    "beta-zero": (yarn(beta_fast=0), "rope_parameters.beta_fast must be a finite number in (0, "),
    "truncate-string": (yarn(truncate="no"), "rope_parameters.truncate must be true or false"),
    "attention-factor-negative": (yarn(attention_factor=-1), "rope_parameters.attention_factor"),
    "mscale-string": (yarn(mscale="1"), "rope_parameters.mscale must be"),
    "old-style-huge": (
        keys(rope_scaling={**YARN, "type": "yarn", "factor": 1e308, "rope_theta": 1e4}),
        "rope_scaling.factor 1e+308",
    ),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_bad_yarn_parameters_are_one_line(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    edit, says = YARN_CASES[case]
    assert_target_refused(tiny_model, edit, says, tmp_path, monkeypatch)


ROPE_CASES = {
    "theta-string": (keys(rope_theta="abc"), "rope_theta must be a finite number > 1"),
    "theta-zero": (
        keys(rope_parameters={"rope_type": "default", "rope_theta": 0}),
        "rope_parameters.rope_theta must be a finite number > 1",
    ),
    "theta-nowhere": (
        keys(rope_parameters={"rope_type": "default"}, rope_theta=DROP),
        "qwen3 needs rope_theta",
    ),
    "parameters-list": (keys(rope_parameters=[1, 2]), "rope_parameters must be an object"),
    "parameters-string": (keys(rope_parameters="yarn"), "rope_parameters must be an object"),
    "scaling-string": (keys(rope_scaling="yarn"), "rope_scaling must be an object"),
    "scaling-list": (keys(rope_scaling=[1]), "rope_scaling must be an object"),
    "type-number": (
        keys(rope_parameters={"rope_type": 5, "rope_theta": 1e4}),
        "rope_parameters.rope_type must be a string",
    ),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_bad_rope_settings_are_one_line(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    edit, says = ROPE_CASES[case]
    assert_target_refused(tiny_model, edit, says, tmp_path, monkeypatch)


SHAPE_CASES = {
    "hidden-size-string": (keys(hidden_size="64"), "hidden_size must be an integer"),
    "vocab-size-zero": (keys(vocab_size=0), "vocab_size must be an integer in [1, "),
    "vocab-size-missing": (keys(vocab_size=DROP), "qwen3 needs vocab_size"),
    "layers-fraction": (keys(num_hidden_layers=1.5), "num_hidden_layers must be"),
    "heads-null": (keys(num_attention_heads=None), "num_attention_heads must be"),
    "kv-heads-not-dividing": (keys(num_key_value_heads=3), "num_key_value_heads 3 does not"),
    "kv-heads-zero": (keys(num_key_value_heads=0), "num_key_value_heads must be"),
    "head-dim-zero": (keys(head_dim=0), "head_dim must be an integer"),
    "head-dim-null": (keys(head_dim=None), "head_dim must be an integer"),
    "head-dim-odd": (keys(head_dim=15), "head_dim must be even"),
    "norm-eps-zero": (keys(rms_norm_eps=0), "rms_norm_eps must be a finite number > 0"),
    "norm-eps-string": (keys(rms_norm_eps="1e-6"), "rms_norm_eps must be"),
    "positions-huge": (keys(max_position_embeddings=2**40), "max_position_embeddings must be"),
    "positions-fraction": (keys(max_position_embeddings=512.5), "max_position_embeddings must"),
    "tied-string": (keys(tie_word_embeddings="false"), "tie_word_embeddings must be true or"),
    "eos-string": (keys(eos_token_id="x"), "eos_token_id must be an integer or a list"),
    "eos-strings": (keys(eos_token_id=["x"]), "eos_token_id must be an integer or a list"),
    "dtype-number": (keys(dtype=5), "dtype must be a string"),
    "quantization-list": (keys(quantization_config=[1]), "quantization_config must be an object"),
    "model-type-number": (keys(model_type=3), "model_type is 3"),
    "model-type-list": (keys(model_type=["qwen3"]), "model_type is ['qwen3']"),
}


def test_a_target_with_sliding_window_layers_is_refused(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers attends through the window in those layers; the target's attention is
    full: refused rather than run with outputs that differ from the model's."""
    copy = config_only_copy(tiny_model, tmp_path / "target")
    config = json.loads((copy / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=None)
    (copy / "config.json").write_text(json.dumps(config))
    write_input(tmp_path / "in")
    flags = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    says = "target: sliding-window attention layers are not supported in a target"
    assert_refused_alike([*flags, "--target", str(copy)], says, tmp_path / "out", monkeypatch)


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_bad_shape_keys_are_one_line(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    edit, says = SHAPE_CASES[case]
    assert_target_refused(tiny_model, edit, says, tmp_path, monkeypatch)


def test_a_config_that_is_no_object_is_one_line(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = config_only_copy(tiny_model, tmp_path / "target")
    (copy / "config.json").write_text("[[1, 2]]")
    flags = ["--target", str(copy)]
    write_input(tmp_path / "in")
    base = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    message = f"{copy / 'config.json'} holds list, not a JSON object"
    assert_refused_alike([*base, *flags], message, tmp_path / "out", monkeypatch)


# A draft's own keys: (its config.json's top-level keys, the format, what the line says).
DRAFT_CASES: dict[str, tuple[dict[str, Any], bool, str]] = {
    "block-size-string": ({"block_size": "4"}, False, "block_size must be an integer"),
    "dflash-config-string": ({"dflash_config": "x"}, False, "dflash_config must be an object"),
    "mask-id-string": (
        {"dflash_config": {"mask_token_id": "1"}},
        False,
        "dflash_config.mask_token_id must be an integer",
    ),
    "layer-ids-string": (
        {"dflash_config": {"mask_token_id": 1, "target_layer_ids": "x"}},
        False,
        "dflash_config.target_layer_ids must be a list of integers",
    ),
    "causal-string": ({"is_causal": "no"}, False, "is_causal must be true or false"),
    "anchor-string": ({"sample_from_anchor": "false"}, False, "sample_from_anchor must be"),
    "target-layers-string": ({"num_target_layers": "2"}, False, "num_target_layers must be"),
    "draft-vocab-string": ({"draft_vocab_size": "100"}, False, "draft_vocab_size must be"),
    "layer-types-string": ({"layer_types": "full_attention"}, False, "layer_types must be"),
    "window-layers-string": ({"max_window_layers": "x"}, False, "max_window_layers must be"),
    "sliding-string": ({"use_sliding_window": "yes"}, False, "use_sliding_window must be"),
    "window-string": ({"sliding_window": "6"}, False, "sliding_window must be an integer"),
    "hidden-size-string": ({"hidden_size": "64"}, False, "hidden_size must be an integer"),
    "moe-layers": ({"model_type": "qwen3_moe"}, False, "model_type is 'qwen3_moe'"),
    "speculators-non-causal-string": (
        {"sliding_window_non_causal": "no"},
        True,
        "sliding_window_non_causal must be true or false",
    ),
    "speculators-hidden-string": ({"target_hidden_size": "64"}, True, "target_hidden_size must"),
    "speculators-aux-ids-string": (
        {"aux_hidden_state_layer_ids": "x"},
        True,
        "aux_hidden_state_layer_ids must be a list of integers",
    ),
    "speculators-block-size-string": ({"block_size": "4"}, True, "block_size must be"),
    "speculators-layers-string": (
        {"transformer_layer_config": "x"},
        True,
        "transformer_layer_config must be an object",
    ),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_bad_draft_keys_are_one_line(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    extra, speculators, says = DRAFT_CASES[case]
    draft = make_tiny_draft(
        tmp_path / "draft", tiny_model, block_size=4, extra_config=extra, speculators=speculators
    )
    flags = ["--target", str(tiny_model), "--draft", str(draft)]
    refused_naming(flags, draft / "config.json", says, tmp_path, monkeypatch)


# -- item 6: refusals validate missed -------------------------------------------------------


def test_a_yarn_factor_of_zero_is_refused_not_taken_as_unset(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    says = "rope_parameters.factor must be a finite number >= 1 or null, got 0"
    assert_target_refused(tiny_model, yarn(factor=0), says, tmp_path, monkeypatch)


def test_a_fractional_expert_count_is_the_configs_error_not_the_tokenizers(
    moe_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    says = "num_experts_per_tok must be an integer in [1, 2147483647], got 2.5"
    line = assert_target_refused(
        moe_model, keys(num_experts_per_tok=2.5), says, tmp_path, monkeypatch
    )
    assert "tokenizer" not in line


def test_a_key_only_transformers_reads_is_the_configs_error_not_the_tokenizers(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention_bias: batchrun reads no such key, but transformers refuses the config, which
    it reads to load the tokenizer."""
    line = assert_target_refused(
        tiny_model,
        keys(attention_bias="yes"),
        "transformers does not read it",
        tmp_path,
        monkeypatch,
    )
    assert "'attention_bias'" in line and "tokenizer" not in line


# -- item 2: a key left out means what it means to transformers ------------------------------

# 32 heads: the default key/value heads (Qwen3's 32, Qwen3-MoE's 4) divide them.
MINIMAL = {
    "vocab_size": 96,
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
}


@pytest.mark.parametrize("model_type", list(TABLES))
def test_every_key_left_out_takes_transformers_default(model_type: str) -> None:
    config = {"model_type": model_type, **MINIMAL}
    settings = checked_config(json.loads(json.dumps(config)), "test")
    hf = CONFIG_MAPPING[model_type].from_dict(json.loads(json.dumps(config)))
    rope = {"rope_theta", "rope_parameters", "rope_scaling"}  # see the next test
    read = TABLES[model_type].keys() & settings.keys() - rope
    assert {"head_dim", "num_key_value_heads", "max_position_embeddings"} < read
    assert "norm_topk_prob" in read or "norm_topk_prob" not in TABLES[model_type]
    for key in sorted(read):
        # Qwen3-MoE's config has no head_dim: its attention takes hidden_size // heads.
        expected = getattr(hf, key, MINIMAL["hidden_size"] // MINIMAL["num_attention_heads"])
        assert settings[key] == expected, key


YARN_256 = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
ROPES = {
    # transformers reads rope_scaling over rope_parameters, and a theta in them over one beside.
    "both-styles": {
        "rope_scaling": YARN_256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
        "rope_theta": 5.0,
    },
    "theta-beside-and-inside": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
        "rope_theta": 5.0,
    },
    "old-type-key": {
        "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        "rope_theta": 3.0,
    },
    "null-factor": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": None,
            "original_max_position_embeddings": 256,
            "rope_theta": 3.0,
        },
    },
}


@pytest.mark.parametrize("case", list(ROPES))
def test_rope_is_read_as_transformers_reads_it(case: str) -> None:
    config = {"model_type": "qwen3", **MINIMAL, "max_position_embeddings": 512} | ROPES[case]
    settings = checked_config(json.loads(json.dumps(config)), "test")
    hf = CONFIG_MAPPING["qwen3"].from_dict(json.loads(json.dumps(config))).rope_parameters
    assert settings["rope_theta"] == hf["rope_theta"]
    yarn = settings["rope_scaling"]
    assert (yarn is None) == (hf["rope_type"] == "default")
    if yarn is not None:
        factor = hf["factor"] or 512 / hf["original_max_position_embeddings"]  # null: the ratio
        assert yarn["factor"] == factor
