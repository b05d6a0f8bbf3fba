"""The asset tools: the BPE tokenizer, the tiny checkpoints and their command line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)

from batchrun.tools import bpe, tiny

MakeModel = Callable[..., Path]


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def test_split_is_stable_disjoint_and_mostly_train() -> None:
    train, heldout = bpe.split_files()
    assert (train, heldout) == bpe.split_files()
    assert not set(train) & set(heldout)
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in train + heldout)


def test_training_is_deterministic(tmp_path: Path) -> None:
    files = bpe.split_files()[0]
    for name in ("a", "b"):
        bpe.build_tokenizer(tmp_path / name, vocab_size=400, files=files, max_bytes=100_000)
    first, second = ((tmp_path / n / "tokenizer.json").read_bytes() for n in ("a", "b"))
    assert first == second


def test_tokenizer_round_trips_held_out_text(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    assert len(tok) == 1024
    texts = [p.read_text(encoding="utf-8")[:3000] for p in bpe.split_files()[1][:20]]
    texts.append("naïve café 日本語 🙂\r\n\t  x = 12345\n")
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # Code compresses: a trained vocabulary does much better than one token per byte.
    sample = "".join(texts[:-1])
    assert len(tok.encode(sample)) < 0.5 * len(sample.encode())


def test_special_tokens(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    ids = tok.convert_tokens_to_ids(list(bpe.SPECIAL_TOKENS))
    assert ids == [0, 1, 2]
    assert tok.eos_token == bpe.IM_END and tok.pad_token == bpe.ENDOFTEXT
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, *tok.encode("user"), 2]
    assert tok.decode([1, *tok.encode("hi"), 2], skip_special_tokens=True) == "hi"


def test_chat_template(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + "<|im_start|>assistant\n"
    assert tok.encode(prompt).count(tok.convert_tokens_to_ids(bpe.IM_START)) == 3


@pytest.mark.parametrize(
    "shape, files",
    [
        ({}, ["model.safetensors"]),
        ({"num_kv_heads": 4, "tie_word_embeddings": False, "num_shards": 2}, None),
        ({"num_kv_heads": 1, "num_layers": 3, "num_shards": 3}, None),
        ({"hidden_size": 48, "vocab_size": 1088}, ["model.safetensors"]),
    ],
)
def test_checkpoint_has_the_asked_shape(
    make_model: MakeModel, shape: dict, files: list[str] | None, tokenizer_dir: Path
) -> None:
    path = make_model(**shape)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    cfg = model.config
    expected = {
        "hidden_size": 64,
        "num_layers": 2,
        "num_kv_heads": 2,
        "tie_word_embeddings": True,
        "num_shards": 1,
        "vocab_size": 1024,
    } | shape
    assert cfg.hidden_size == expected["hidden_size"]
    assert cfg.num_hidden_layers == expected["num_layers"]
    assert (cfg.num_attention_heads, cfg.head_dim) == (4, 16)
    assert cfg.num_key_value_heads == expected["num_kv_heads"]
    assert cfg.vocab_size == expected["vocab_size"] >= len(load_tokenizer(path))
    assert model.get_input_embeddings().weight.shape == (cfg.vocab_size, cfg.hidden_size)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == expected["tie_word_embeddings"]

    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) == expected["num_shards"]
    if files is not None:
        assert shards == files
    else:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
    saved = set()
    for shard in shards:
        with safe_open(str(path / shard), "pt") as f:
            saved |= set(f.keys())
    assert ("lm_head.weight" in saved) != expected["tie_word_embeddings"]

    gen = GenerationConfig.from_pretrained(str(path))
    assert gen.eos_token_id == load_tokenizer(path).convert_tokens_to_ids(bpe.IM_END)
    assert (path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_norm_weights_are_not_all_ones(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert param.std() > 0.1, name


def test_greedy_tokens_are_decisive_and_depend_on_context(make_model: MakeModel) -> None:
    """Top-1/top-2 logit gaps far above float32 noise keep greedy oracle tests deterministic;
    few echoes of the input token mean the tokens depend on attention, not on embeddings alone."""
    for shape in ({}, {"tie_word_embeddings": False, "num_kv_heads": 4}):
        model = AutoModelForCausalLM.from_pretrained(str(make_model(**shape))).eval()
        ids = torch.randint(3, 1024, (8, 64), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = model(ids).logits
            noise = (model.double()(ids).logits - logits.double()).abs().max().item()
        top2 = logits.topk(2, dim=-1).values
        gap = top2[..., 0] - top2[..., 1]
        assert noise < 1e-4
        assert (gap < 100 * noise).float().mean() < 0.01
        assert gap.median() > 0.1
        assert (logits.argmax(-1) == ids).float().mean() < 0.2


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        tiny.make_tiny_model(tmp_path, vocab_size=500, tokenizer_dir=tokenizer_dir)


def test_command_line(tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "ckpt"
    tiny.main(
        [str(out), "--layers", "1", "--untied", "--shards", "2", "--tokenizer", str(tokenizer_dir)]
    )
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert len(list(out.glob("*.safetensors"))) == 2
