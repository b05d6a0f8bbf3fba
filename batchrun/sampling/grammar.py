"""Structured outputs: a row's constraint (a JSON Schema, a regular expression or a choice of
strings) compiled into a grammar over the target's tokens, with xgrammar.

xgrammar rather than llguidance, by measurement on this workload (a JSON Schema with strings,
an integer, an enum array and a boolean, 151,936 tokens, one CPU core): a row's next-token
mask took 6 us with xgrammar and 44 us with llguidance, and batchrun builds one per verify row
on the host while the GPU runs the step, so the host's share grows with rows x width. Both
compile such a schema in milliseconds.

xgrammar is imported when the first constrained row needs it (about two seconds), so jobs
without constraints neither pay for it nor need it. Grammars compile in processes of their
own, once per constraint text, under a budget (grammar_compile.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from batchrun.sampling.constraint import Constraint, GrammarError, choice_grammar
from batchrun.sampling.grammar_compile import CompileBudget, CompileJob, CompilePool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary (in compile processes, under a
    budget: grammar_compile.py) and makes their matchers."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_ids: Iterable[int],
        budget: CompileBudget | None = None,
    ) -> None:
        import xgrammar

        self._xgr = xgrammar
        # The model's vocabulary may be larger than the tokenizer's: ids past it are masked.
        self._info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids) or None
        )
        self._pool = CompilePool(budget or CompileBudget(), self._info.serialize_json())
        weakref.finalize(self, self._pool.close)  # its compile processes end with it
        self._loaded = threading.Lock()  # a compile's result becomes its grammar once
        self.vocab_size = vocab_size

    def submit(self, constraint: Constraint) -> CompileJob:
        """The constraint's compile, started (or found under way, or done) without waiting."""
        kind, value = constraint.kind, constraint.value
        text = choice_grammar(value) if kind == "choice" or isinstance(value, tuple) else value
        size = len(text.encode("utf-8", "surrogatepass"))
        return self._pool.submit((kind, value), kind, size, constraint)

    def poll(self, job: CompileJob) -> bool:
        """Whether the compile is over (its time budget applied)."""
        return self._pool.poll(job)

    def wait(self, jobs: list[CompileJob], seconds: float | None) -> None:
        """Until one of the compiles is over, or `seconds` have passed (None: no limit)."""
        self._pool.wait(jobs, seconds)

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar, waited for; GrammarError when it does not compile, or breaks
        the budget."""
        job = self.submit(constraint)
        self.wait([job], None)
        return self.grammar_of(job)

    def grammar_of(self, job: CompileJob) -> Any:
        """The grammar of a finished compile; GrammarError when it has none."""
        with self._loaded:
            if job.error is not None:
                raise GrammarError(job.error)
            if job.grammar is None:
                job.grammar = self._xgr.CompiledGrammar.deserialize_json(job.result, self._info)
                job.result = None
            return job.grammar

    def matcher(self, constraint: Constraint) -> Any:
        """A matcher at the start of the output; it can take back any number of tokens."""
        return self._xgr.GrammarMatcher(self.compile(constraint))

    def matcher_of(self, job: CompileJob) -> Any:
        """A matcher of a finished compile's grammar, at its start."""
        return self._xgr.GrammarMatcher(self.grammar_of(job))

    def bitmask(self, rows: int) -> Any:
        """A host bitmask for `rows` rows, every token allowed (bit set)."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)
