"""Writes tests/fixtures/dflash2_rounds.json: the plain reference's (dflash2_reference.py)
greedy DFlash2 generation, every round's anchor, drafts and committed tokens, for the tests'
tiny target and a random DFlash2 drafter in the published layout, both rebuilt from their seeds.
The test (tests/spec_decode/test_dflash2_expected.py) rebuilds them the same way and checks
batchrun's rounds against this file, so it fetches and recomputes nothing of the reference.

    python -m tests.helpers.dflash2_expected
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from batchrun.tools.bpe import build_tokenizer
from batchrun.tools.tiny import make_tiny_model
from tests.helpers.dflash2_models import make_tiny_dflash2
from tests.helpers.dflash2_reference import reference_generate2
from tests.helpers.dflash_reference import one_thread
from tests.helpers.dflash_train import TARGET_SHAPE

FIXTURE = Path(__file__).parent.parent / "fixtures" / "dflash2_rounds.json"
TOKENIZER = {"vocab_size": 1024, "max_bytes": 1_000_000}  # conftest's tokenizer
DRAFT = {"num_layers": 2, "target_layer_ids": [1, 2], "seed": 11, "sliding_window": 6}
PROMPT_LENGTHS = [1, 4, 9, 17]
MAX_TOKENS = 16
EOS = 2


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2026)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def build_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) under root, from their seeds."""
    tokenizer = root / "tokenizer"
    build_tokenizer(tokenizer, **TOKENIZER)
    target = make_tiny_model(root / "target", tokenizer_dir=tokenizer, **TARGET_SHAPE)
    return target, make_tiny_dflash2(root / "draft", target, **DRAFT)


def expected(target: Path, draft: Path) -> list[dict[str, Any]]:
    runs = []
    with one_thread():
        for prompt in prompts():
            out, rounds = reference_generate2(target, draft, prompt, MAX_TOKENS, [EOS])
            runs.append({"prompt": prompt, "output": out, "rounds": [list(r) for r in rounds]})
    return runs


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        runs = expected(*build_pair(Path(root)))
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({"draft": DRAFT, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
