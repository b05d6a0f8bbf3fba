"""Scratch checkpoints at a model's shape (batchrun/bench/scratch_models.py), at a tiny shape on
the CPU: they load in transformers and batchrun alike, whole jobs run on them with and without
the draft, and a complete directory is reused while a half-written one is rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrun.bench.scratch_models import (
    MARKER,
    eos_id,
    mask_id,
    write_scratch_models,
    write_target,
)
from batchrun.bench.shapes import random_target
from batchrun.config.job import JobSpec
from batchrun.models.dflash_loader import load_dflash
from batchrun.models.loader import checkpoint_tensors, load_qwen3
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.runners.local import run_job
from batchrun.tools.tiny_draft import random_draft_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

SHAPE = Qwen3Shape(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
CPU = torch.device("cpu")
PROMPTS = [[5, 17, 300], [999], list(range(40, 60)), [7, 7, 7, 7]]
MAX_TOKENS = 12


def scratch(root: Path) -> tuple[Path, Path]:
    """The tiny target and a 2-layer draft (block 4) over both its layers."""
    target, draft = write_scratch_models(
        root, SHAPE, torch.float32, CPU, draft_layers=2, block_size=4, target_layer_ids=[0, 1]
    )
    assert draft is not None
    return target, draft


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return scratch(tmp_path_factory.mktemp("scratch"))


def hf_greedy(target: Path, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
    )
    return list(out[0, len(prompt) :].tolist())


def run(tmp_path: Path, target: Path, draft: Path | None) -> pa.Table:
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    table = pa.table({"prompt_token_ids": pa.array(PROMPTS, pa.list_(pa.int32()))})
    pq.write_table(table, inputs / "prompts.parquet")
    out = tmp_path / ("with-draft" if draft else "target-only")
    job = JobSpec.from_keys(
        dict(
            input=str(inputs),
            output=str(out),
            target=str(target),
            draft=str(draft) if draft else None,
            max_tokens=MAX_TOKENS,
            device="cpu",
            dtype="float32",
            quiet=True,
        )
    )
    run_job(job)
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")


def test_target_loads_in_transformers_and_batchrun(models: tuple[Path, Path]) -> None:
    target, _ = models
    ours, config = load_qwen3(target, "float32", CPU)
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    hf_state = hf.state_dict()
    written = checkpoint_tensors(ours)
    assert written.keys() == hf_state.keys()
    # Seed 0: shapes.random_target's weights, read back the same by both loaders.
    for name, tensor in checkpoint_tensors(random_target(SHAPE, torch.float32, CPU)).items():
        assert torch.equal(written[name], tensor), name
        assert torch.equal(hf_state[name], tensor), name
    assert config["eos_token_id"] == eos_id(SHAPE.vocab_size) == SHAPE.vocab_size - 1
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == 999


def test_tokenizer_covers_the_vocabulary(models: tuple[Path, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(models[0]))
    assert len(tokenizer) == SHAPE.vocab_size
    assert tokenizer.eos_token_id == eos_id(SHAPE.vocab_size)
    words = [tokenizer.decode([i]) for i in range(256, SHAPE.vocab_size)]
    assert words == [f"t{i}" for i in range(256, SHAPE.vocab_size)]
    text = '{"name": "ü\u20ac", "n": [1, 2]}\n'  # any text: byte by byte
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < 256 and tokenizer.decode(ids) == text
    assert eos_id(151936) == 151645 and mask_id(151936) == 151935
    assert mask_id(SHAPE.vocab_size) == SHAPE.vocab_size - 2  # the last id is the eos here


def test_draft_is_zlab_layout_and_loads(models: tuple[Path, Path]) -> None:
    target, draft_dir = models
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 998, "target_layer_ids": [0, 1]}
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    zlab = random_draft_weights(config, num_features=2, seed=0)  # tiny_draft's z-lab names
    assert shapes == {name: list(t.shape) for name, t in zlab.items()}
    model, _ = load_qwen3(target, "float32", CPU)
    draft = load_dflash(draft_dir, model, CPU, max_positions=64)
    assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (4, 998, (0, 1))


def test_jobs_run_with_and_without_the_draft(tmp_path: Path, models: tuple[Path, Path]) -> None:
    target, draft = models
    plain, speculative = run(tmp_path, target, None), run(tmp_path, target, draft)
    for table in (plain, speculative):
        assert table.num_rows == len(PROMPTS)
        assert table["error"].null_count == len(PROMPTS)
    assert speculative["completion_token_ids"] == plain["completion_token_ids"]
    assert all(r > 0 for r in speculative["spec_rounds"].to_pylist())
    # The job's tokens are generate()'s on the same checkpoint (cut at its eos).
    for prompt, tokens in zip(PROMPTS, plain["completion_token_ids"].to_pylist(), strict=True):
        assert hf_greedy(target, prompt)[: len(tokens)] == tokens


def test_a_complete_directory_is_reused_and_an_incomplete_one_rewritten(tmp_path: Path) -> None:
    target, draft = scratch(tmp_path)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    mtimes = [p.stat().st_mtime_ns for p in files]
    scratch(tmp_path)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files
    assert [p.stat().st_mtime_ns for p in files] == mtimes
    # A killed run leaves no marker: the directory is cleared and written again.
    (target / MARKER).unlink()
    (target / "stale.safetensors").write_bytes(b"half")
    scratch(tmp_path)
    assert (target / MARKER).is_file() and not (target / "stale.safetensors").exists()
    assert [p.stat().st_mtime_ns for p in files if p.parent == draft] == [
        m for p, m in zip(files, mtimes, strict=True) if p.parent == draft
    ]
    # Another shape (here dtype) is no reuse either.
    write_scratch_models(tmp_path, SHAPE, torch.bfloat16, CPU, draft=False)
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"


def test_small_shards_and_their_index(tmp_path: Path) -> None:
    target = write_target(tmp_path, SHAPE, torch.float32, CPU, max_shard_bytes=100_000)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    held, total = {}, 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                held[name] = file.name
                total += tensor.numel() * tensor.element_size()
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == total
    expected = checkpoint_tensors(random_target(SHAPE, torch.float32, CPU))
    assert held.keys() == expected.keys()
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_random_shape_models_live_on_their_device_with_a_float32_rope() -> None:
    """bench --shape builds its models on the GPU; anything left on the host (the RoPE table is
    built there) fails its first kernel. The meta device stands in for the GPU here."""
    from batchrun.bench.shapes import random_draft

    meta = torch.device("meta")
    shape = Qwen3Shape(**{**SHAPE.__dict__, "num_layers": 6})
    target = random_target(shape, torch.bfloat16, meta)
    draft = random_draft(target, shape, max_positions=512)
    for model in (target, draft):
        tensors = [*model.parameters(), *model.buffers()]
        assert all(t.device == meta for t in tensors)
        assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32


def test_a_moe_shape_writes_a_qwen3_moe_checkpoint(tmp_path: Path) -> None:
    """The MoE job benchmark's checkpoint: transformers reads it as Qwen3-MoE and batchrun
    loads it with its experts (the config names them, not only the tensors)."""
    from dataclasses import replace

    moe = replace(SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    target = write_target(tmp_path, moe, torch.float32, CPU)
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen3_moe"
    loaded, _ = load_qwen3(target, "float32", CPU)
    assert loaded.shape.num_experts == 4 and loaded.shape.moe_intermediate_size == 32
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"


def test_random_fp8_projections_dequantize_to_the_bf16_spread() -> None:
    """`--fp8-weights` shapes (and `bench --fp8-gemm`'s weights): float8_e4m3fn values whose
    scales bring them to the std 0.02 every other random weight has."""
    from dataclasses import replace

    from batchrun.bench.shapes import FP8_SCALE
    from batchrun.layers.fp8_linear import Fp8Linear
    from batchrun.models.fp8 import Fp8Scheme

    fp8 = replace(SHAPE, hidden_size=256, intermediate_size=512, fp8=Fp8Scheme((32, 32)))
    model = random_target(fp8, torch.float32, CPU)
    kept = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(kept) == 4 * fp8.num_layers
    for layer in kept:
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.all(layer.weight_scale_inv == FP8_SCALE)
        std = (layer.weight.float() * layer.weight_scale_inv.max()).std().item()
        assert 0.018 < std < 0.022, std
