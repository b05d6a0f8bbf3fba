"""The demo-pair trainers at toy scale on CPU: corpus split, target, prompts, DFlash drafter."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen3ForCausalLM

from batchrun.tools.bpe import ENDOFTEXT, python_files
from batchrun.train import draft as draft_train
from batchrun.train import draft_data, draft_model
from batchrun.train import prompts as prompts_cli
from batchrun.train import target as target_cli
from batchrun.train.corpus import Corpus, load_corpus, token_stream
from tests.helpers.dflash_reference import (
    draft_block_logits,
    read_draft,
    reference_generate,
    target_pass,
)

MakeModel = Callable[..., Path]
PADDED_ROWS = 8
BLOCK = 4

ZLAB_CONFIG_KEYS = {
    "architectures",
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "tie_word_embeddings",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "dtype",
    "block_size",
    "num_target_layers",
    "dflash_config",
}
LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return load_corpus()


@pytest.fixture(scope="module")
def small_corpus(stdlib: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of a few small stdlib files, both splits, at their own relative paths."""
    root = tmp_path_factory.mktemp("lib")

    def smallest(files: tuple[Path, ...], count: int) -> list[Path]:
        sized = [f for f in files if 2_000 < f.stat().st_size < 12_000]
        return sorted(sized, key=lambda f: (f.stat().st_size, f))[:count]

    for f in smallest(stdlib.train, 10) + smallest(stdlib.heldout, 2):
        dest = root / stdlib.relative(f)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    return root


@pytest.fixture(scope="module")
def draft_target(make_model: MakeModel, tokenizer_dir: Path) -> Path:
    """A tiny random target with padded embedding rows, one of which becomes the mask token."""
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir))) + PADDED_ROWS
    return make_model(vocab_size=vocab, num_layers=3)


# ---- corpus ----


def test_corpus_split_is_by_file_disjoint_and_stable(
    stdlib: Corpus, small_corpus: Path, tokenizer_dir: Path
) -> None:
    train, heldout = set(stdlib.train), set(stdlib.heldout)
    assert not train & heldout
    assert train | heldout == {stdlib.root / p for p in python_files(stdlib.root)}
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    assert load_corpus() == stdlib
    # A file's side depends on its relative path only, not on which other files exist.
    copy = load_corpus(small_corpus)
    assert {copy.relative(f) for f in copy.heldout} <= {stdlib.relative(f) for f in heldout}
    assert {copy.relative(f) for f in copy.train} <= {stdlib.relative(f) for f in train}
    assert copy.heldout and copy.train

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = tokenizer.get_vocab()[ENDOFTEXT]
    stream = token_stream(tokenizer, copy.heldout, eos)
    assert (stream == eos).sum() == len(copy.heldout)
    assert stream[-1] == eos


# ---- target ----


def train_tiny_target(out: Path, corpus: Path, tokenizer_dir: Path) -> None:
    target_cli.main(
        [
            "--out",
            str(out),
            "--corpus-root",
            str(corpus),
            "--tokenizer",
            str(tokenizer_dir),
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--warmup",
            "2",
            "--log-every",
            "2",
            "--eval-tokens",
            "256",
            "--hidden",
            "32",
            "--layers",
            "2",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "16",
            "--intermediate",
            "64",
            "--padded-rows",
            str(PADDED_ROWS),
            "--device",
            "cpu",
        ]
    )


def test_target_trainer_writes_a_loadable_deterministic_checkpoint(
    tmp_path: Path, small_corpus: Path, tokenizer_dir: Path
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    train_tiny_target(first, small_corpus, tokenizer_dir)
    train_tiny_target(second, small_corpus, tokenizer_dir)

    tokenizer = AutoTokenizer.from_pretrained(str(first))
    eos = tokenizer.get_vocab()[ENDOFTEXT]
    assert tokenizer.eos_token_id == eos
    generation = json.loads((first / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos
    config = json.loads((first / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) + PADDED_ROWS
    assert config["tie_word_embeddings"] and config["max_position_embeddings"] == 1024

    with safe_open(str(first / "model.safetensors"), "pt") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    with safe_open(str(second / "model.safetensors"), "pt") as f:
        assert all(torch.equal(weights[name], f.get_tensor(name)) for name in weights)

    model = Qwen3ForCausalLM.from_pretrained(str(first), dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode("def f(x):\n    return x\n")])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], config["vocab_size"])

    report = json.loads((first / "train_report.json").read_text())
    assert report["steps_done"] == 4 and len(report["train_loss"]["curve"]) == 2
    assert 0 < report["heldout"]["loss_per_token"] < 20
    assert report["environment"]["python"]
    assert report["corpus"]["heldout_files"] == 2


# ---- prompts ----


def test_prompts_are_code_prefixes_of_heldout_files_only(
    tmp_path: Path, stdlib: Corpus, tokenizer_dir: Path
) -> None:
    out = tmp_path / "demo" / "prompts.parquet"
    args = ["--tokenizer", str(tokenizer_dir), "--out", str(out), "--count", "12"]
    prompts_cli.main(args)
    table = pq.read_table(out)
    assert table.schema.names == ["prompt", "source"]
    assert table.schema.types == [pa.string(), pa.string()]
    rows = table.to_pylist()
    assert len(rows) == 12 and len({r["prompt"] for r in rows}) == 12

    heldout = {stdlib.relative(f): f for f in stdlib.heldout}
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for row in rows:
        assert row["source"] in heldout
        first_line = row["prompt"].splitlines()[0]
        assert first_line.startswith(("def ", "class ", "async def "))
        assert first_line in heldout[row["source"]].read_text(encoding="utf-8")
        assert 30 <= len(tokenizer.encode(row["prompt"])) <= 80

    again = tmp_path / "again.parquet"
    prompts_cli.main(["--tokenizer", str(tokenizer_dir), "--out", str(again), "--count", "12"])
    assert pq.read_table(again).equals(table)


# ---- draft ----


@torch.no_grad()
def greedy(target: Qwen3ForCausalLM, prompt: list[int], count: int) -> list[int]:
    """The target's greedy continuation, one full forward per token (tiny models: fast)."""
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def completions_parquet(target_dir: Path, corpus: Path, path: Path, count: int) -> None:
    """A Parquet file shaped like batchrun output: the target's greedy completions of stdlib
    prompts, plus one error row that the trainer must skip."""
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    spec = prompts_cli.PromptSpec(count=count, min_tokens=8, max_tokens=24)
    found = prompts_cli.make_prompts(load_corpus(corpus), "train", tokenizer, spec)
    texts = [text for text, _ in found]
    assert len(texts) == count
    completions = [greedy(target, tokenizer.encode(text), 24) for text in texts]
    table = pa.table(
        {
            "prompt": texts + ["x = 1"],
            "completion_token_ids": pa.array(completions + [None], pa.list_(pa.int32())),
            "error": [None] * len(texts) + ["prompt too long"],
        }
    )
    pq.write_table(table, path)


def float32_copy(draft_dir: Path, out: Path) -> Path:
    """The draft with float32 weights: the reference computes in float32 throughout."""
    out.mkdir()
    shutil.copy(draft_dir / "config.json", out / "config.json")
    weights = load_file(str(draft_dir / "model.safetensors"))
    save_file({k: v.float() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def saved_draft(
    draft_dir: Path, target: Qwen3ForCausalLM
) -> tuple[draft_model.TrainableDraft, list[int], int]:
    """A saved draft loaded back for training code: (module in float32, layer ids, mask id)."""
    config = json.loads((draft_dir / "config.json").read_text())
    layer_ids = config["dflash_config"]["target_layer_ids"]
    module_config = draft_model.draft_model_config(target, config["num_hidden_layers"])
    draft = draft_model.TrainableDraft(module_config, len(layer_ids))
    weights = load_file(str(draft_dir / "model.safetensors"))
    draft.load_state_dict({k: v.float() for k, v in weights.items()})
    return draft, layer_ids, config["dflash_config"]["mask_token_id"]


def test_draft_training_forward_equals_the_reference_draft(
    tmp_path: Path, draft_target: Path
) -> None:
    """Many anchors in one masked forward give each block what the plain draft gives it."""
    target = draft_model.load_frozen_target(draft_target, torch.device("cpu"))
    layer_ids, mask_id = [0, 2], target.config.vocab_size - 1
    draft = draft_model.TrainableDraft(draft_model.draft_model_config(target, 2), len(layer_ids))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from 1: a skipped norm shows
    run = draft_train.DraftRun(block_size=BLOCK, num_layers=2)
    draft_train.save_draft(draft, tmp_path / "d", draft_target, run, layer_ids, mask_id)
    draft, _, _ = saved_draft(tmp_path / "d", target)
    reference = read_draft(float32_copy(tmp_path / "d", tmp_path / "d32"))

    ids = torch.randint(0, target.config.vocab_size, (2, 20))
    anchors = torch.tensor([[2, 9, 15], [4, 5, 16]])
    features = draft_model.target_features(target, ids, layer_ids)
    with torch.no_grad():
        batched = draft_model.draft_logits(draft, target, features, ids, anchors, mask_id, BLOCK)
    for n in range(2):
        _, ref_features = target_pass(target, ids[n].tolist(), layer_ids)
        assert torch.allclose(ref_features, features[n], atol=1e-5)
        for k, p in enumerate(anchors[n].tolist()):
            expected = draft_block_logits(reference, target, ref_features[:p], ids[n, p])
            assert torch.allclose(batched[n, k], expected, atol=1e-4), (n, k)


def test_draft_data_takes_token_id_prompts_and_skips_unusable_rows(
    tmp_path: Path, draft_target: Path
) -> None:
    path = tmp_path / "rows.parquet"
    table = pa.table(
        {
            "prompt_token_ids": [[5, 6, 7], [8, 9], [10], [11, 12]],
            "completion_token_ids": pa.array(
                [[1, 2, 3], None, [4], [13, 14, 15, 16]], pa.list_(pa.int32())
            ),
            "error": [None, "bad parameter", None, None],
        }
    )
    pq.write_table(table, path)
    tokenizer = AutoTokenizer.from_pretrained(str(draft_target))
    rows, counts = draft_data.read_rows([str(path)], tokenizer, max_len=5)
    assert rows == [
        draft_data.TokenRow([5, 6, 7, 1, 2], 3),  # cut to max_len
        draft_data.TokenRow([11, 12, 13, 14, 15], 2),
    ]
    assert counts == {"files": 1, "rows": 4, "error_rows": 1, "short_rows": 1}


def test_draft_trainer_writes_a_zlab_draft_and_learns(
    tmp_path: Path, draft_target: Path, small_corpus: Path
) -> None:
    data = tmp_path / "out" / "part-000000.parquet"
    data.parent.mkdir()
    completions_parquet(draft_target, small_corpus, data, count=16)
    out = tmp_path / "draft"
    draft_train.main(
        [
            "--target",
            str(draft_target),
            "--data",
            str(data.parent),
            "--out",
            str(out),
            "--block-size",
            str(BLOCK),
            "--layers",
            "1",
            "--steps",
            "48",
            "--batch-size",
            "4",
            "--anchors",
            "8",
            "--lr",
            "3e-3",
            "--warmup",
            "4",
            "--log-every",
            "8",
            "--eval-rows",
            "4",
            "--device",
            "cpu",
        ]
    )

    config = json.loads((out / "config.json").read_text())
    assert set(config) == ZLAB_CONFIG_KEYS
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == BLOCK and config["num_target_layers"] == 3
    tokenizer = AutoTokenizer.from_pretrained(str(draft_target))
    assert config["dflash_config"] == {"target_layer_ids": [1], "mask_token_id": len(tokenizer)}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.0.{t}" for t in LAYER_TENSORS}
    assert names == expected

    report = json.loads((out / "train_report.json").read_text())
    assert report["data"]["error_rows"] == 1 and report["data"]["rows"] == 17
    curve = [p["loss"] for p in report["train_loss"]["curve"]]
    assert len(curve) == 6 and curve[-1] < 0.8 * curve[0]
    tau = report["heldout_tau"]
    assert tau["rows"] == 1  # at most a tenth of the rows is held out
    assert 1.0 <= tau["tau"] <= BLOCK
    assert sum(tau["accept_hist"]) == tau["rounds"]


def test_offline_tau_replays_reference_rounds(
    tmp_path: Path, draft_target: Path, small_corpus: Path
) -> None:
    """The tau estimate commits what real greedy DFlash rounds commit (the reference's)."""
    data = tmp_path / "data.parquet"
    completions_parquet(draft_target, small_corpus, data, count=6)
    out = tmp_path / "draft"
    draft_train.main(
        [
            "--target",
            str(draft_target),
            "--data",
            str(data),
            "--out",
            str(out),
            "--block-size",
            str(BLOCK),
            "--steps",
            "24",
            "--batch-size",
            "4",
            "--anchors",
            "8",
            "--lr",
            "3e-3",
            "--warmup",
            "2",
            "--log-every",
            "8",
            "--device",
            "cpu",
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(draft_target))
    rows, _ = draft_data.read_rows([str(data)], tokenizer, max_len=1024)
    target = draft_model.load_frozen_target(draft_target, torch.device("cpu"))
    draft, layer_ids, mask_id = saved_draft(out, target)
    setup = draft_train.Setup(target, draft, layer_ids, mask_id, 0, torch.device("cpu"))
    estimate = draft_train.estimate_tau(setup, rows, BLOCK)

    reference_dir = float32_copy(out, tmp_path / "draft32")
    hist = [0] * BLOCK
    for row in rows:
        prompt, completion = row.ids[: row.prompt_len], row.ids[row.prompt_len :]
        generated, rounds = reference_generate(
            draft_target, reference_dir, prompt, len(completion), []
        )
        assert generated == completion
        for r in rounds:
            hist[len(r.committed) - 1] += 1
    assert estimate["accept_hist"] == hist
    assert sum(hist[1:]) > 0  # some rounds accepted drafts: the acceptance path is exercised
