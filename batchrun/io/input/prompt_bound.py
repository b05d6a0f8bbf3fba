"""A lower bound on a text's token count that costs no tokenizing, for refusing huge prompts.

A vocabulary entry is at least as long as the text it stands for (byte-level BPE spells each
byte as one character; SentencePiece and WordPiece markers only add characters), so with L the
longest entry, added special tokens included, a text of n characters needs at least ceil(n / L)
tokens. (A normaliser that drops or merges characters could beat the bound; Qwen's does not.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """L: the characters of the tokenizer's longest vocabulary entry."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def fewest_tokens(chars: int, longest_token: int) -> int:
    """The fewest tokens a text of `chars` characters can tokenize to."""
    return -(-chars // longest_token)
