"""The Python source corpus: the running interpreter's standard library, split by file.

The split is bpe.split_files's (a hash of each file's path relative to the stdlib root), so the
tokenizer, the target, the prompts and the drafter all agree on which files are held out. The
stdlib differs between interpreters; reports record the version that was used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from batchrun.tools.bpe import read_texts, split_files, stdlib_root


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]  # absolute paths, sorted by relative path
    heldout: tuple[Path, ...]

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def files(self, split: str) -> tuple[Path, ...]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        return self.train if split == "train" else self.heldout


def load_corpus(root: Path | None = None) -> Corpus:
    """The .py files under root (default: this interpreter's stdlib), split train / held-out."""
    root = stdlib_root() if root is None else Path(root)
    train, heldout = split_files(root)
    return Corpus(root, tuple(train), tuple(heldout))


def token_stream(
    tokenizer: PreTrainedTokenizerBase, files: Sequence[Path], separator_id: int
) -> np.ndarray:
    """Every file's tokens, each followed by separator_id, concatenated as one int32 array.

    Files are tokenized in one batch call, which a fast tokenizer spreads over all cores.
    """
    texts = list(read_texts(files))
    encoded = (
        tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    )
    pieces = [np.asarray([*ids, separator_id], dtype=np.int32) for ids in encoded]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
