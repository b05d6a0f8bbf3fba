"""A model directory's tokenizer and end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.errors import JobError

THINK_START, THINK_END = "<think>", "</think>"  # Qwen3's think block


def think_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int] | None:
    """The ids of <think> and </think> where the tokenizer has each as one token."""
    start, end = _single_id(tokenizer, THINK_START), _single_id(tokenizer, THINK_END)
    return (start, end) if start is not None and end is not None else None


def think_opened(prompt: list[int], think: tuple[int, int]) -> bool:
    """The prompt's last think token opens a block (the template started the thinking)."""
    for token in reversed(prompt):
        if token in think:
            return token == think[0]
    return False


def _single_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


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
