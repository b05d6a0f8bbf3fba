"""A row's sampling parameters, each declared once (batchrun/sampling/option.py): its type,
range, default, help and where it may be set. The job's flags, JSON Schema, override columns
and fingerprint keys are derived from these declarations (batchrun/config/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.sampling.constraint import Constraint
from batchrun.sampling.option import Kind, Record, declared, option
from batchrun.sampling.option_rules import rule_problem

SEED_MIN, SEED_END = -(1 << 63), 1 << 64  # a seed's range; the engine uses it modulo 2^64
MAX_SAMPLES = 1024  # n per row: a bad cell must not fill memory with requests


@dataclass(frozen=True)
class SamplingParams:
    """What a row asks of sampling. The job's defaults are one (seeded with the job seed); a
    row's cells replace its fields. problem() says whether the values can run."""

    max_tokens: int = option(
        256,
        kind=Kind.INT,
        low=1,
        doc="Default maximum number of generated tokens per row.",
        help="Maximum tokens generated per row.",
        column=True,
        record=Record.ALWAYS,
    )
    temperature: float = option(  # 0 = greedy
        0.0,
        kind=Kind.FLOAT,
        low=0,
        doc="Default sampling temperature; 0 is greedy and reproducible.",
        help="Sampling temperature; 0 is greedy.",
        column=True,
        record=Record.ALWAYS,
    )
    top_p: float = option(
        1.0,
        kind=Kind.FLOAT,
        low=0,
        low_open=True,
        high=1,
        doc="Default nucleus sampling mass; 1 keeps every token.",
        help="Nucleus sampling mass; 1 keeps every token.",
        column=True,
        record=Record.ALWAYS,
    )
    top_k: int = option(  # 0 = off
        0,
        kind=Kind.INT,
        low=0,
        note="(0 = off)",
        doc="Default top-k cutoff; 0 turns it off.",
        help="Top-k cutoff; 0 = off.",
        column=True,
        record=Record.ALWAYS,
    )
    seed: int = option(
        0,
        kind=Kind.INT,
        low=SEED_MIN,
        high=SEED_END - 1,
        doc="Job seed, any integer in [-2^63, 2^64), used modulo 2^64 (so -1 and 2^64-1 sample "
        "alike); a row without a `seed` cell gets a distinct seed derived from it and its "
        "row_index (and each of its n samples one of its own).",
        help="Job seed, any integer in [-2^63, 2^64), used modulo 2^64; each row gets its own.",
        column=True,
        record=Record.ALWAYS,
    )
    stop: tuple[str, ...] = option(
        (),
        kind=Kind.STRINGS,
        doc="Default stop strings; the completion is cut before the first one.",
        help="Stop string (repeatable).",
        column=True,
        record=Record.ALWAYS,
    )
    stop_token_ids: tuple[int, ...] = option(
        (),
        kind=Kind.TOKEN_IDS,
        doc="Default token ids that end generation (in addition to EOS).",
        help="Stop token id (repeatable).",
        column=True,
        record=Record.ALWAYS,
    )
    n: int = option(  # samples of the row, each with its own seed (sample_seed)
        1,
        kind=Kind.INT,
        low=1,
        high=MAX_SAMPLES,
        doc=f"Default samples per row (at most {MAX_SAMPLES}): n output rows with sample_index "
        "0 .. n-1, each with its own seed, sharing the prompt's K/V.",
        help="Samples per row (n output rows, sample_index 0 .. n-1).",
        column=True,
        record=Record.ALWAYS,
    )
    ignore_eos: bool = option(  # an end-of-sequence token is output and generation goes on
        False,
        kind=Kind.BOOL,
        doc="Generate past end-of-sequence tokens (they are output) until max_tokens or a "
        "stop; a per-row column ignore_eos overrides it.",
        help="Generate past end-of-sequence tokens until max_tokens or a stop.",
        column=True,
        record=Record.WHEN_SET,
    )
    # Tokens a think block may take before its end is forced (None: no limit).
    max_thinking_tokens: int | None = option(
        None,
        kind=Kind.INT,
        low=0,
        doc="Tokens a completion's think block may take (at least one); then its end "
        "(\\n</think>\\n\\n) is forced and the answer follows. Needs <think> and </think> "
        "tokens; a per-row column max_thinking_tokens overrides it.",
        help="Tokens a think block may take; then its end is forced and the answer follows.",
        unset="no limit",
        column=True,
        record=Record.WHEN_SET,
    )
    # Logit controls, as vLLM defines them (batchrun/sampling/penalties.py applies them).
    presence_penalty: float = option(  # over output tokens
        0.0,
        kind=Kind.FLOAT,
        low=-2,
        high=2,
        doc="Subtracted from the logit of each token the output holds so far (vLLM's); a "
        "per-row column presence_penalty overrides it.",
        help="Subtracted from the logit of each token the output holds, in [-2, 2].",
        column=True,
        record=Record.WHEN_SET,
    )
    frequency_penalty: float = option(  # per occurrence in the output
        0.0,
        kind=Kind.FLOAT,
        low=-2,
        high=2,
        doc="Subtracted from a token's logit once per occurrence in the output so far (vLLM's); "
        "a per-row column frequency_penalty overrides it.",
        help="Subtracted per occurrence in the output from a token's logit, in [-2, 2].",
        column=True,
        record=Record.WHEN_SET,
    )
    repetition_penalty: float = option(  # 1 = off; over prompt and output tokens
        1.0,
        kind=Kind.FLOAT,
        low=0,
        low_open=True,
        doc="Divides the positive logits, and multiplies the negative ones, of tokens in the "
        "prompt or the output so far (transformers' and vLLM's); 1 is off. A per-row column "
        "repetition_penalty overrides it.",
        help="Divides positive (multiplies negative) logits of tokens in the prompt or output; "
        "1 = off.",
        column=True,
        record=Record.WHEN_SET,
    )
    min_tokens: int = option(  # no end-of-sequence, stop id or stop string before this many
        0,
        kind=Kind.INT,
        low=0,
        at_most="max_tokens",
        doc="Tokens generated before an end-of-sequence token, a stop token id or a stop string "
        "may end a row (the ids are masked until then); at most max_tokens. A per-row column "
        "min_tokens overrides it.",
        help="Tokens generated before an end-of-sequence token, stop id or stop string may end "
        "a row.",
        column=True,
        record=Record.WHEN_SET,
    )
    logit_bias: tuple[tuple[int, float], ...] = option(  # (token id, bias), sorted by id
        (),
        kind=Kind.TOKEN_BIAS,
        low=-100,
        high=100,
        doc="Token id -> bias added to its logit before sampling, e.g. "
        '{"151645" = -100}; ids must be in the target\'s vocabulary. A per-row column '
        "logit_bias (a JSON object string, or a struct) replaces it.",
        column=True,
        record=Record.WHEN_SET,
    )
    min_p: float = option(  # drop tokens below min_p x the top probability
        0.0,
        kind=Kind.FLOAT,
        low=0,
        high=1,
        doc="After temperature, drop tokens whose probability is below min_p times the most "
        "probable token's (greedy rows are unaffected); 0 is off. A per-row column min_p "
        "overrides it.",
        help="Drop tokens less probable than min_p x the most probable one; 0 = off.",
        column=True,
        record=Record.WHEN_SET,
    )
    constraint: Constraint | None = None  # structured output: what the output must match
    # A reasoning parser splits the output: a constraint holds on the answer after the think
    # block (sampling/row_grammar.py), not from the first token.
    reasoning: bool = False

    def problem(self) -> str | None:
        """Why these parameters cannot run, or None: each option's declared rule in field
        order, then the constraint's. The engine samples in float32, so the float rules hold
        for the float32 values too; a seed is used modulo 2^64."""
        for item, spec in declared(type(self)):
            bound = getattr(self, spec.at_most) if spec.at_most is not None else None
            problem = rule_problem(item.name, spec, getattr(self, item.name), bound)
            if problem is not None:
                return problem
        if self.constraint is not None:
            return self._constraint_problem(self.constraint)
        return None

    def _constraint_problem(self, constraint: Constraint) -> str | None:
        # Tokens the grammar did not choose would leave it behind the output; a thinking
        # budget's forced end closes the think block, before a reasoning row's grammar starts.
        if self.max_thinking_tokens is not None and not self.reasoning:
            return (
                f"{constraint.kind} and max_thinking_tokens do not go together without a "
                "reasoning_parser (the grammar then holds after the think block)"
            )
        if self.ignore_eos:
            return f"{constraint.kind} and ignore_eos do not go together"
        if self.min_tokens:  # its end-of-sequence mask could forbid all the grammar allows
            return f"{constraint.kind} and min_tokens do not go together"
        return constraint.problem()

    def vocab_problem(self, vocab_size: int) -> str | None:
        """Why valid parameters cannot run on a target of this vocabulary, or None."""
        outside = [token for token, _ in self.logit_bias if token >= vocab_size]
        if outside:
            return f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
        return None

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalties: the row needs its token counts."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )

    @property
    def controlled(self) -> bool:
        """Some control changes the row's logits (min_p filters them, as top-p does)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0
