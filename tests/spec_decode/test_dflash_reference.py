"""Self-checks of the test-side DFlash pieces, no engine involved: the tiny draft writer, the
plain reference (lossless against transformers' generate(), for every kind of draft; its
window masks what it should) and the trained drafts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from batchrun.models.dflash import default_target_layer_ids
from batchrun.tools import tiny_draft
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.dflash_reference import (
    load_target,
    read_draft,
    reference_drafts,
    reference_generate,
    target_pass,
)
from tests.helpers.dflash_train import (
    CONTINUATION,
    TRAINED_BLOCK_SIZE,
    TRAINED_VARIANTS,
    trained_draft_beside,
    training_prompts,
)

MakeModel = Callable[..., Path]

# Untied, with embedding rows past the tokenizer (as real Qwen3): the draft must use the
# target's lm_head, and its default mask id is the first unused row.
pytestmark = pytest.mark.usefixtures("one_thread_module")  # module fixtures (drafts) too
PROMPT_LENGTHS = [1, 3, 8, 21]


@pytest.fixture(scope="module")
def random_draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft")
    return make_tiny_draft(out, target, num_layers=2, block_size=4, target_layer_ids=[1, 2])


def prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(target_dir: Path, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    model = load_target(target_dir)
    ids = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos
    )
    return ids[0, len(prompt) :].tolist()


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(5, 36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(1, 36) == [18]
    assert default_target_layer_ids(2, 28) == [1, 25]


def test_draft_checkpoint_is_zlab_format(target: Path, random_draft: Path) -> None:
    config = json.loads((random_draft / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 1024, "target_layer_ids": [1, 2]}
    assert (config["block_size"], config["num_target_layers"], config["num_hidden_layers"]) == (
        4,
        4,
        2,
    )
    target_config = json.loads((target / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[key] == target_config[key]
    assert config["vocab_size"] == 1088
    with safe_open(str(random_draft / "model.safetensors"), framework="pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    layer = {
        "input_layernorm.weight": [64],
        "self_attn.q_proj.weight": [64, 64],
        "self_attn.k_proj.weight": [32, 64],
        "self_attn.v_proj.weight": [32, 64],
        "self_attn.o_proj.weight": [64, 64],
        "self_attn.q_norm.weight": [16],
        "self_attn.k_norm.weight": [16],
        "post_attention_layernorm.weight": [64],
        "mlp.gate_proj.weight": [128, 64],
        "mlp.up_proj.weight": [128, 64],
        "mlp.down_proj.weight": [64, 128],
    }
    expected = {"fc.weight": [64, 128], "hidden_norm.weight": [64], "norm.weight": [64]}
    expected |= {f"layers.{i}.{name}": shape for i in range(2) for name, shape in layer.items()}
    assert shapes == expected


def test_draft_defaults_and_cli(make_model: MakeModel, target: Path, tmp_path: Path) -> None:
    # Without spare embedding rows the mask falls back to the last row; no ids -> key omitted.
    unpadded = make_model(num_layers=4)
    make_tiny_draft(tmp_path / "a", unpadded, num_layers=3)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 1023}
    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="pt") as f:
        assert list(f.get_slice("fc.weight").get_shape()) == [64, 3 * 64]

    tiny_draft.main([str(tmp_path / "b"), "--target", str(target), "--layer-ids", "0,3"])
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 1024, "target_layer_ids": [0, 3]}

    tiny_draft.main(
        [
            str(tmp_path / "c"),
            "--target",
            str(target),
            "--layers",
            "3",
            "--layer-ids",
            "0,2,3",
            "--speculators",
            "--sliding-window",
            "9",
            "--sliding-layers",
            "0,2",
            "--draft-vocab",
            "100",
        ]
    )
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    layers = config["transformer_layer_config"]
    assert config["speculators_model_type"] == "dflash" and config["draft_vocab_size"] == 100
    assert config["aux_hidden_state_layer_ids"] == [1, 3, 4]  # hidden-state indices
    assert layers["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (layers["use_sliding_window"], layers["sliding_window"]) == (True, 9)
    with safe_open(str(tmp_path / "c" / "model.safetensors"), framework="pt") as f:
        assert list(f.get_slice("lm_head.weight").get_shape()) == [100, 64]
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    ids = torch.arange(100) + d2t  # offsets: target id = draft id + d2t[draft id]
    assert t2d.sum() == 100 and bool(t2d[ids].all()) and bool((ids[1:] > ids[:-1]).all())


def test_features_are_layer_outputs(target: Path) -> None:
    """f_l is the residual stream after layer l: HF's hidden_states[l + 1], except for the last
    layer, whose HF hidden state has the final norm applied and the feature does not."""
    model = load_target(target)
    ids = [5, 77, 300, 12, 9]
    _, feats = target_pass(model, ids, [0, 1, 2, 3])
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    per_layer = feats.view(len(ids), 4, 64)
    for layer in range(3):
        torch.testing.assert_close(per_layer[:, layer], hidden[layer + 1][0])
    torch.testing.assert_close(model.model.norm(per_layer[:, 3]), hidden[4][0])
    assert not torch.allclose(per_layer[:, 3], hidden[4][0])


@pytest.mark.parametrize(
    ("seed", "kind"), [(0, "z-lab"), (1, "z-lab"), (0, "sliding"), (0, "speculators-vocab")]
)
def test_random_draft_is_lossless(
    target: Path, random_draft: Path, tmp_path: Path, seed: int, kind: str
) -> None:
    variants: dict[str, dict[str, Any]] = {
        "sliding": {"sliding_window": 5, "sliding_layers": [1]},
        "speculators-vocab": {"speculators": True, "draft_vocab": list(range(0, 1088, 5))},
    }
    if kind != "z-lab":
        random_draft = make_tiny_draft(
            tmp_path / kind,
            target,
            num_layers=2,
            block_size=4,
            target_layer_ids=[1, 2],
            **variants[kind],
        )
    for prompt in prompts(1024, seed):
        expected = hf_greedy(target, prompt, 24, [2])
        out, rounds = reference_generate(target, random_draft, prompt, 24, [2])
        assert out == expected
        assert [t for r in rounds for t in r.committed] == out[1:]
        # A stop token the target emits mid-run cuts there, as generate() does.
        stop = out[len(out) // 2]
        out, rounds = reference_generate(target, random_draft, prompt, 24, [stop])
        assert out == hf_greedy(target, prompt, 24, [stop])
        assert out[-1] == stop and stop not in out[:-1]


def test_a_window_over_the_whole_context_changes_no_draft(target: Path, tmp_path: Path) -> None:
    """The same weights with every layer sliding, non-causal: a window longer than the context
    drafts what full attention drafts, a window of 4 does not (it drops context)."""
    common: dict[str, Any] = {"num_layers": 2, "block_size": 4, "target_layer_ids": [1, 2]}
    full = make_tiny_draft(tmp_path / "full", target, **common)
    noncausal = {
        "dflash_config": {"mask_token_id": 1024, "target_layer_ids": [1, 2], "causal": False}
    }
    drafts = []
    for window in (1000, 4):
        sliding = make_tiny_draft(
            tmp_path / f"w{window}",
            target,
            **common,
            sliding_window=window,
            extra_config=noncausal,
        )
        assert read_draft(sliding).windows == [window, window]
        sequence = prompts(1024, 2)[3] + list(range(40, 60))
        drafts.append(reference_drafts(target, sliding, sequence, list(range(5, 40))))
    expected = reference_drafts(target, full, sequence, list(range(5, 40)))
    assert drafts[0] == expected
    assert drafts[1] != expected


@pytest.mark.parametrize("variant", list(TRAINED_VARIANTS))
def test_trained_draft_accepts_often_but_not_always(target: Path, variant: str) -> None:
    draft = trained_draft_beside(target, variant)
    hist = [0] * TRAINED_BLOCK_SIZE
    for prompt in training_prompts(seed=0):
        out, rounds = reference_generate(target, draft, prompt, CONTINUATION, [2])
        assert out == hf_greedy(target, prompt, CONTINUATION, [2])
        position = len(prompt)
        for r in rounds:
            assert (r.position, r.anchor) == (position, (prompt + out)[position])
            position += len(r.committed)
            hist[len(r.committed) - 1] += 1
    tau = sum(k * n for k, n in enumerate(hist, start=1)) / sum(hist)
    assert tau > 1.5, hist
    assert sum(n > 0 for n in hist) >= 3, hist
