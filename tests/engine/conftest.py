"""The engine tests' shared fixtures: a tiny Qwen3.5 text checkpoint with its tokenizer (module
scoped: each module builds its own, a second or so)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from batchrun.tools.bpe import build_tokenizer
from tests.helpers.hybrid_models import VOCAB, make_hybrid, with_tokenizer


@pytest.fixture(scope="module")
def hybrid_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE tokenizer over the tiny hybrids' vocabulary (VOCAB ids)."""
    out = tmp_path_factory.mktemp("hybrid-tokenizer")
    build_tokenizer(out, vocab_size=VOCAB, max_bytes=200_000)
    return out


@pytest.fixture(scope="module")
def text_pair(
    tmp_path_factory: pytest.TempPathFactory, hybrid_tokenizer: Path
) -> tuple[Path, nn.Module]:
    """The Qwen3.5 text checkpoint the drafter and reuse tests run on, and transformers' model."""
    out = tmp_path_factory.mktemp("qwen3_5_text")
    reference = make_hybrid(out, "qwen3_5_text")
    with_tokenizer(out, hybrid_tokenizer)
    return out, reference


@pytest.fixture(scope="module")
def text_hybrid(text_pair: tuple[Path, nn.Module]) -> Path:
    return text_pair[0]
