"""A model directory's tokenizer and end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.errors import JobError


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
