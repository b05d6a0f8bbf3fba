"""Shared fixtures: one locally trained tokenizer per session, tiny random Qwen3 checkpoints and
the tests' bigram speculation method."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Models and tokenizers are built locally by the tests; never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only in Triton's interpreter, chosen when triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

from batchrun.spec_decode.registry import METHODS  # noqa: E402
from batchrun.tools.bpe import build_tokenizer  # noqa: E402
from batchrun.tools.tiny import make_tiny_model  # noqa: E402
from tests.helpers.bigram_method import Bigram  # noqa: E402
from tests.helpers.dflash_reference import one_thread as single_thread  # noqa: E402
from tests.helpers.dflash_train import TARGET_SHAPE  # noqa: E402

TOKENIZER_VOCAB = 1024
# A smaller corpus than the default keeps the session's one training run around a second.
TOKENIZER_BYTES = 1_000_000

MakeModel = Callable[..., Path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread: tiny models run fastest so, without contending for the cores."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def one_thread_module() -> Iterator[None]:
    """one_thread for a whole module, its module-scoped fixtures (trained drafts) included."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def target(make_model: MakeModel) -> Path:
    """The tiny target the DFlash tests share (their trained drafts are for it)."""
    return make_model(**TARGET_SHAPE)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, vocab_size=TOKENIZER_VOCAB, max_bytes=TOKENIZER_BYTES)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    """The test tokenizer, loaded once a module (a module may define its own)."""
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def make_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> MakeModel:
    """make_model(**shape) -> checkpoint dir; make_tiny_model's keywords, each shape built once."""
    cache: dict[tuple[tuple[str, Any], ...], Path] = {}

    def make(**shape: Any) -> Path:
        key = tuple(sorted(shape.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("tiny-model")
            cache[key] = make_tiny_model(out, tokenizer_dir=tokenizer_dir, **shape)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(make_model: MakeModel) -> Path:
    return make_model()


@pytest.fixture
def bigram(monkeypatch: pytest.MonkeyPatch) -> Bigram:
    """The bigram method (tests/helpers/bigram_method.py), registered for this test only."""
    method = Bigram()
    monkeypatch.setitem(METHODS, method.name, method)
    return method
