"""Checkpoints stored in half precision load exactly, and the engine runs in every dtype."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.models.loader import checkpoint_tensors
from batchrun.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bf16")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


def engine(target: Path, dtype: str) -> Engine:
    return Engine(EngineConfig(target=target, device="cpu", dtype=dtype, num_pages=32))


def test_bf16_checkpoint_upcasts_exactly_on_cpu(bf16_checkpoint: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(str(bf16_checkpoint), dtype=torch.bfloat16)
    eng = engine(bf16_checkpoint, "auto")  # auto on a CPU: float32
    ours = checkpoint_tensors(eng.model)
    assert ours["model.embed_tokens.weight"].dtype == torch.float32
    for name, param in hf.named_parameters():
        assert torch.equal(ours[name], param.float()), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_runs_in_half_precision(tiny_model: Path, dtype: str) -> None:
    eng = engine(tiny_model, dtype)
    assert eng.info()["dtype"] == dtype
    assert eng.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    req = Request(0, [5, 6, 7, 8], SamplingParams(max_tokens=6))
    eng.add(req)
    while eng.num_unfinished:
        eng.step()
    assert len(req.output.token_ids) == 6 and req.output.finish_reason == "length"
