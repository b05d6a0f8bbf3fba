"""Train a small byte-level BPE tokenizer on Python source and save it as real tokenizer files.

The corpus defaults to the running interpreter's standard library, so tests and the demo model
need nothing from outside the machine. Everything is deterministic: the file list is sorted, the
held-out split is a hash of each file's relative path, and BPE training is a pure function of
its input.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2/Qwen3's split rule: digits one by one, words with their leading space or punctuation.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen renders it (no default system message, like Qwen3 without tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path) -> list[Path]:
    """Every .py file under root (installed packages excluded), as sorted relative paths."""
    excluded = {"site-packages", "dist-packages", "__pycache__"}
    found = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(p for p in found if not excluded.intersection(p.parts))


def _bucket(key: str) -> int:
    """A stable number in [0, 100) for a name, independent of the machine and of hash seeds."""
    digest = hashlib.sha1(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100


def split_files(
    root: Path | None = None, *, heldout_percent: int = 10
) -> tuple[list[Path], list[Path]]:
    """Absolute (train, held-out) files under root, split by a hash of each relative path."""
    root = stdlib_root() if root is None else root
    train: list[Path] = []
    heldout: list[Path] = []
    for rel in python_files(root):
        (heldout if _bucket(rel.as_posix()) < heldout_percent else train).append(root / rel)
    return train, heldout


def read_texts(files: Sequence[Path], max_bytes: int | None = None) -> Iterator[str]:
    """The files' texts, undecodable ones skipped, stopping once max_bytes have been read.

    Under a budget, files are taken in hash order rather than alphabetically, so that a small
    budget still samples the whole tree instead of its first few modules.
    """
    ordered = sorted(files, key=lambda p: (_bucket(p.name), p)) if max_bytes else files
    total = 0
    for path in ordered:
        if max_bytes is not None and total >= max_bytes:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text.encode())
        yield text


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE whose vocabulary (special tokens and 256 bytes included) is vocab_size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def wrap(tokenizer: Tokenizer, model_max_length: int = 32768) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a trained one, with Qwen's special tokens and template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        # Byte-level BPE decodes exactly; the default cleanup would alter spaces in code.
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(
    out_dir: Path | str,
    *,
    vocab_size: int = 1024,
    files: Sequence[Path] | None = None,
    max_bytes: int | None = 2_000_000,
) -> PreTrainedTokenizerFast:
    """Train on files (default: the stdlib's train split), save to out_dir and return it."""
    files = split_files()[0] if files is None else files
    tokenizer = wrap(train_bpe(read_texts(files, max_bytes), vocab_size))
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
