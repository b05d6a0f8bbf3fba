"""A row's constraint (a JSON Schema, a regular expression or a choice of strings), what makes
it one batchrun can hold a completion to, and its compile by an xgrammar compiler: apart from
grammar.py's Grammars, so the compile processes (compile_worker.py) import it without the pool
that starts them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from batchrun.sampling.json_schema_support import json_schema_problem
from batchrun.sampling.regex_dialect import regex_problem

KINDS = ("json_schema", "regex", "choice")


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match: kind json_schema (the schema as JSON text), regex (a
    regular expression over the whole output) or choice (one of the strings, exactly)."""

    kind: str
    value: str | tuple[str, ...]

    def problem(self) -> str | None:
        """Why this cannot be a constraint, judged before compiling it (None: it may be): also
        a schema or regex xgrammar would compile but not enforce in full."""
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
        if self.kind == "json_schema":
            return json_schema_problem(self.value)
        return regex_problem(self.value)


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the row's error."""


def compile_constraint(compiler: Any, constraint: Constraint) -> Any:
    """The constraint compiled by an xgrammar compiler (a compile process's); GrammarError
    when it does not compile."""
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "choice" or isinstance(value, tuple):
            return compiler.compile_grammar(choice_grammar(value))
        if kind == "json_schema":
            # No free whitespace between tokens: a model can pad JSON with spaces until
            # max_tokens (the demo's does); items are separated by ", " and ": ".
            return compiler.compile_json_schema(value, any_whitespace=False)
        return compiler.compile_regex(value)
    except RuntimeError as exc:  # xgrammar's parse errors
        raise GrammarError(f"{constraint.kind} does not compile: {_message(exc)}") from None


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
