"""Structured outputs (JSON Schema, regex, choice): the engine's output is exactly greedy
constrained decoding (a reference loop over transformers' logits with the same grammar), with
and without a DFlash draft, and it matches its constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.runners.local import run_job
from batchrun.sampling.constraint import Constraint, GrammarError
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.grammar_masks import ConstrainedRows, build_masks
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.row_grammar import RowGrammar
from tests.helpers.engine_runs import cpu_engine, run_to_end

DEMO = Path(__file__).resolve().parents[2] / "batchrun" / "demo"
TARGET, DRAFT = DEMO / "target", DEMO / "draft"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["list", "dict", "tuple"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "kind", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint("json_schema", json.dumps(SCHEMA)),
    Constraint("regex", r"def [a-z_]{1,12}\((x|y|z)\): return [0-9]{1,3}"),
    Constraint("choice", ("yes", "no", "maybe not")),
]
PROMPTS = ["def parse(items):\n    result = ", "# a config\nconfig = ", "import os\n"]
MAX_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    vocab = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    return Grammars(tokenizer, vocab, [tokenizer.eos_token_id])


def matches(constraint: Constraint, text: str) -> bool:
    if constraint.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(str(constraint.value)))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint.kind == "regex":
        return re.fullmatch(str(constraint.value), text) is not None
    return text in constraint.value


def reference(grammars: Grammars, constraint: Constraint, prompt: list[int]) -> list[int]:
    """Greedy constrained decoding over transformers' logits, one token at a time."""
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    eos = AutoTokenizer.from_pretrained(TARGET).eos_token_id
    matcher, bits = grammars.matcher(constraint), grammars.bitmask(1)
    ids, out = list(prompt), []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bits, 0)
        allowed = (bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        logits[allowed.view(-1)[: logits.shape[0]] == 0] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == eos:
            break
        assert matcher.accept_token(token)
        ids.append(token)
    return out


def run_engine(draft: Path | None, constraints: list[Constraint], **settings: int) -> list[Request]:
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    engine = cpu_engine(TARGET, draft, max_batch_size=4, num_pages=256, **settings)
    requests = [
        Request(
            i,
            tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
            SamplingParams(max_tokens=MAX_TOKENS, constraint=c),
        )
        for i, c in enumerate(constraints)
    ]
    return sorted(run_to_end(engine, requests), key=lambda r: r.row_index)


def test_constrained_rows_are_exactly_greedy_constrained_decoding_with_and_without_a_draft(
    grammars: Grammars,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    plain = run_engine(None, CONSTRAINTS)
    drafted = run_engine(DRAFT, CONSTRAINTS, verify_width="full")  # type: ignore[arg-type]
    for req, with_draft, constraint in zip(plain, drafted, CONSTRAINTS, strict=True):
        expected = reference(grammars, constraint, req.prompt_ids)
        assert req.output.token_ids == expected, constraint.kind
        assert with_draft.output.token_ids == expected, constraint.kind
        assert req.output.finish_reason == "stop"
        text = tokenizer.decode(req.output.token_ids, skip_special_tokens=True)
        assert matches(constraint, text), text
    # The draft proposed tokens the grammar forbids, and some it allows.
    assert any(r.output.spec_hist is not None and sum(r.output.spec_hist[1:]) for r in drafted)


def test_unconstrained_rows_beside_constrained_ones_are_unchanged() -> None:
    free = run_engine(DRAFT, [None, None, None])  # type: ignore[list-item]
    mixed = run_engine(DRAFT, [None, CONSTRAINTS[0], None])  # type: ignore[list-item]
    assert [free[0].output.token_ids, free[2].output.token_ids] == [
        mixed[0].output.token_ids,
        mixed[2].output.token_ids,
    ]
    assert free[1].output.token_ids != mixed[1].output.token_ids


def test_masks_follow_the_drafts_and_leave_the_matcher_at_the_committed_output(
    grammars: Grammars,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    constraint = Constraint("choice", ("yes", "no"))
    matcher = grammars.matcher(constraint)
    grammar = RowGrammar(matcher)
    y = tokenizer.encode("yes")
    forbidden = tokenizer.encode("x")[0]
    masks = build_masks(
        grammars,
        [ConstrainedRows(grammar, 3, 3, [y[0], forbidden]), ConstrainedRows(grammar, 7, 1, [])],
        torch.device("cpu"),
    )
    assert masks.rows.tolist() == [3, 4, 5, 7]
    logits = torch.zeros(8, grammars.vocab_size)
    masks.apply(logits)
    allowed = [set((row > float("-inf")).nonzero().view(-1).tolist()) for row in logits]
    yes_or_no = {tokenizer.encode("yes")[0], tokenizer.encode("no")[0]}
    assert yes_or_no <= allowed[3] and allowed[3] == allowed[7]  # the start, twice
    assert forbidden not in allowed[4] and len(allowed[4]) < len(allowed[3])  # after "y..."
    assert len(allowed[5]) == grammars.vocab_size  # after a forbidden draft: never committed
    assert len(allowed[0]) == grammars.vocab_size  # rows without a grammar untouched
    assert matcher.accept_token(tokenizer.encode("no")[0])  # still at the start


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json_schema", '{"type": "objekt"}'), "json_schema does not compile: Unsup"),
        (Constraint("json_schema", '{"type": '), "json_schema does not compile: "),
        (Constraint("regex", "a(b"), "regex does not compile: Regex parsing error"),
    ],
)
def test_a_constraint_that_does_not_compile_says_why_in_one_line(
    grammars: Grammars, constraint: Constraint, message: str
) -> None:
    with pytest.raises(GrammarError) as error:
        grammars.compile(constraint)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (SamplingParams(constraint=Constraint("choice", ())), "choice must be a non-empty"),
        (SamplingParams(constraint=Constraint("choice", ("a", ""))), "choice must be a list of"),
        (SamplingParams(constraint=Constraint("regex", " ")), "regex must be a non-empty"),
        (
            SamplingParams(constraint=CONSTRAINTS[1], max_thinking_tokens=4),
            "regex and max_thinking_tokens do not go together",
        ),
        (
            SamplingParams(constraint=CONSTRAINTS[0], ignore_eos=True),
            "json_schema and ignore_eos do not go together",
        ),
    ],
)
def test_constraint_params_are_checked(params: SamplingParams, problem: str) -> None:
    assert (params.problem() or "").startswith(problem)


def run_rows(tmp_path: Path, columns: dict[str, list[object]], **job: object) -> list[dict]:
    """A job over the demo target with these input columns; its output rows in row order."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    rows = len(next(iter(columns.values())))
    table = pa.table({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(rows)], **columns})
    pq.write_table(table, inputs / "rows.parquet")
    spec = JobSpec.from_keys(
        dict(
            input=str(inputs),
            output=str(tmp_path / "out"),
            target=str(TARGET),
            draft=str(DRAFT),
            max_tokens=MAX_TOKENS,
            device="cpu",
            dtype="float32",
            quiet=True,
            **job,  # type: ignore[arg-type]
        )
    )
    run_job(spec)
    return pl.read_parquet(tmp_path / "out" / "*.parquet").sort("row_index").to_dicts()


def test_row_columns_constrain_their_rows_and_bad_cells_are_error_rows(tmp_path: Path) -> None:
    schema = json.dumps(SCHEMA)
    out = run_rows(
        tmp_path,
        {
            "json_schema": [schema, None, None, '{"type": "objekt"}', schema, None],
            "regex": [None, str(CONSTRAINTS[1].value), None, None, "a+", "(x"],
            "choice": [None, None, ["yes", "no"], None, None, None],
        },
        choice=("left", "right"),  # the job's: rows without their own
    )
    assert len(out) == 6
    assert matches(CONSTRAINTS[0], out[0]["completion"]) and out[0]["error"] is None
    assert matches(CONSTRAINTS[1], out[1]["completion"])
    assert out[2]["completion"] in ("yes", "no")
    assert out[3]["error"].startswith("json_schema is not a valid JSON Schema: 'objekt' is")
    assert out[4]["error"] == "json_schema and regex are both set; a row takes one of them"
    assert out[5]["error"].startswith("regex does not compile:")
    assert all(row["completion"] is None for row in out[3:])


def test_a_job_constraint_that_does_not_compile_refuses_the_job(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="^job key 'regex': regex does not compile: "):
        run_rows(tmp_path, {"n": [1]}, regex="(unclosed")
