"""Start-up helpers of the engine: device, attention backend, tokenizer, eos ids."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.attention.base import AttentionBackend
from batchrun.attention.torch_backend import TorchAttention
from batchrun.errors import JobError
from batchrun.layers.ops import TORCH_OPS, TorchOps


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def backend_name(name: str, device: torch.device) -> str:
    """The backend `name` resolves to on `device`; JobError if it cannot run here. `auto` is
    Triton on a GPU and the torch reference on a CPU (where `triton` runs under Triton's
    interpreter, for tests)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        try:
            import triton  # noqa: F401
        except ImportError:
            raise JobError("attention backend 'triton' needs the triton package") from None
    elif name != "torch":
        raise JobError(
            f"attention backend {name!r} is not available in this build; use 'triton' or 'torch'"
        )
    return name


def attention_backend(
    name: str,
    device: torch.device,
    max_decode_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[AttentionBackend, TorchOps]:
    """The attention backend and the layers' small ops that go with it."""
    if backend_name(name, device) == "torch":
        return TorchAttention(), TORCH_OPS
    from batchrun.attention.triton_backend import TritonAttention
    from batchrun.layers.triton_ops import TritonOps

    return TritonAttention(max_decode_rows, num_heads, num_kv_heads, head_dim), TritonOps()


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds; any of them means no tokenizer
        raise JobError(f"cannot load the tokenizer of {model_dir}: {e}".splitlines()[0]) from None


def eos_token_ids(
    model_dir: Path, config: dict[str, Any], tok: PreTrainedTokenizerBase
) -> set[int]:
    """End-of-sequence ids as generate() uses them: generation_config.json, else the config."""
    eos = None
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id", tok.eos_token_id)
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list) else {int(eos)}
