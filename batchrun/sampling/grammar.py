"""Structured outputs: a row's constraint (a JSON Schema, a regular expression or a choice of
strings) compiled into a grammar over the target's tokens, with xgrammar.

xgrammar rather than llguidance, by measurement on this workload (a JSON Schema with strings,
an integer, an enum array and a boolean, 151,936 tokens, one CPU core): a row's next-token
mask took 6 us with xgrammar and 44 us with llguidance, and batchrun builds one per verify row
on the host while the GPU runs the step, so the host's share grows with rows x width. Both
compile such a schema in milliseconds; xgrammar's compiler caches grammars by their text.

xgrammar is imported when the first constrained row needs it (about two seconds), so jobs
without constraints neither pay for it nor need it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

KINDS = ("json_schema", "regex", "choice")


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match: kind json_schema (the schema as JSON text), regex (a
    regular expression over the whole output) or choice (one of the strings, exactly)."""

    kind: str
    value: str | tuple[str, ...]

    def problem(self) -> str | None:
        """Why this cannot be a constraint, judged without compiling it (None: it may be)."""
        if self.kind == "choice":
            choices = self.value
            if not (isinstance(choices, tuple) and choices):
                return "choice must be a non-empty list of strings"
            if not all(isinstance(c, str) and c for c in choices):
                return "choice must be a list of non-empty strings"
            return None
        if self.kind not in KINDS:
            return f"unknown constraint {self.kind!r}"
        if not (isinstance(self.value, str) and self.value.strip()):
            return f"{self.kind} must be a non-empty string"
        return None


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the row's error."""


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary and makes their matchers."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Iterable[int]
    ) -> None:
        import xgrammar

        self._xgr = xgrammar
        # The model's vocabulary may be larger than the tokenizer's: ids past it are masked.
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (cached by its text); GrammarError when it does not compile."""
        kind, value = constraint.kind, constraint.value
        try:
            if kind == "choice" or isinstance(value, tuple):
                return self._compiler.compile_grammar(choice_grammar(value))
            if kind == "json_schema":
                # No free whitespace between tokens: a model can pad JSON with spaces until
                # max_tokens (the demo's does); items are separated by ", " and ": ".
                return self._compiler.compile_json_schema(value, any_whitespace=False)
            return self._compiler.compile_regex(value)
        except RuntimeError as exc:  # xgrammar's parse errors
            raise GrammarError(f"{constraint.kind} does not compile: {_message(exc)}") from None

    def matcher(self, constraint: Constraint) -> Any:
        """A matcher at the start of the output; it can take back any number of tokens."""
        return self._xgr.GrammarMatcher(self.compile(constraint))

    def bitmask(self, rows: int) -> Any:
        """A host bitmask for `rows` rows, every token allowed (bit set)."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)


def choice_grammar(choices: str | tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string literals are
    xgrammar's EBNF string literals)."""
    options = (choices,) if isinstance(choices, str) else choices
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in options)


def _message(exc: RuntimeError) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.splitlines()[0] if text else "unknown error"
