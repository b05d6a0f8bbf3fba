"""A stop row's completion satisfies its constraint: a schema or regex the grammar would not enforce
in full is refused (the job in one line, a row's cell as its error row), and every finished stop
row is checked against its whole constraint after generation, an error saying why it fails."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xgrammar
from click.testing import CliRunner
from transformers import AutoTokenizer
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request, RequestOutput
from batchrun.errors import JobError
from batchrun.io.input.cells import without_nulls
from batchrun.io.input.prompts import PromptColumn, PromptKind, RequestBuilder
from batchrun.io.output.columns import finished_row
from batchrun.runners.local import run_job
from batchrun.sampling.constraint import Constraint
from batchrun.sampling.constraint_check import violation
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.json_schema_support import support_table
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.regex_dialect import python_regex, regex_problem
from batchrun.sampling.xgrammar_warnings import xgrammar_warnings

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "batchrun" / "demo"
TARGET, DRAFT = DEMO / "target", DEMO / "draft"
STR, INT = {"type": "string"}, {"type": "integer"}
NOT_UNIQUE = {"type": "array", "items": STR, "uniqueItems": True}


def dumps(value: Any) -> str:
    """JSON as the grammar writes it (", " and ": " between items)."""
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


# Schemas with JSON that breaks them. Each is refused, or its grammar rejects that JSON.
BROKEN = [
    (NOT_UNIQUE, [["a", "a", "a"]]),
    ({"type": "array", "items": INT, "contains": {"const": 7}}, [[0]]),
    ({"type": "array", "items": INT, "contains": {"const": 7}, "maxContains": 1}, [[7, 7]]),
    ({"oneOf": [INT, {"type": "number"}]}, [1]),
    ({"allOf": [{"type": "integer", "maximum": 9}, {"minimum": 5}]}, [4, 10**40]),
    ({"$ref": "http://example.com/s.json"}, []),
    ({"$defs": {"i": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, ["x"]),
    ({"$defs": {"i": INT}, "$ref": "#/$defs/i", "maximum": 3}, [4]),
    ({"type": "integer", "maximum": 3, "anyOf": [{"minimum": 0}, {"maximum": -5}]}, [4]),
    ({"not": INT}, [1]),
    ({"if": INT, "then": {"minimum": 5}, "else": STR}, [1]),
    (
        {"type": "object", "properties": {"a": STR, "b": STR}, "dependentRequired": {"a": ["b"]}},
        [{"a": "x"}],
    ),
    ({"type": "object", "required": ["a"]}, [{}]),
    ({"type": "object", "properties": {"a": STR}, "required": ["b"]}, [{"a": "x"}]),
    (
        {"type": "object", "properties": {"abc": INT}, "propertyNames": {"maxLength": 2}},
        [{"abc": 1}],
    ),
    ({"type": "string", "enum": ["a", 1]}, [1]),
    ({"const": "abc", "maxLength": 1}, ["abc"]),
    ({"maximum": 9}, [10]),
    ({"minLength": 3}, ["ab"]),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, [4]),
    ({"type": "integer", "multipleOf": 1.5}, [4]),
    ({"type": "number", "multipleOf": 0.5}, [0.3]),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, ["abc"]),
    ({"type": "string", "format": "email", "maxLength": 5}, ["abcdef@g.com"]),
    ({"type": "string", "format": "regex"}, ["("]),
    ({"type": "string", "pattern": "a^b"}, ["ab"]),
    ({"type": "string", "maxLength": -1}, ["a"]),
    ({"type": "integer", "maximum": 9}, [10, 10**40]),  # supported: the grammar rejects these
    ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, [{}, {"a": "x"}]),
    ({"type": "array", "items": INT, "minItems": 1, "maxItems": 2}, [[], [1, 2, 3]]),
    ({"type": "string", "enum": ["a", "b"]}, ["c"]),
    ({"oneOf": [INT, STR]}, [True]),
    ({"type": "string", "format": "date"}, ["2020-13-45x"]),
]


@pytest.mark.parametrize(("schema", "breaking"), BROKEN, ids=lambda v: json.dumps(v)[:50])
def test_a_schema_is_refused_or_its_grammar_rejects_json_that_breaks_it(
    schema: dict[str, Any], breaking: list[Any]
) -> None:
    text = json.dumps(schema)
    checker = jsonschema.FormatChecker()
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=checker)
    assert not any(validator.is_valid(value) for value in breaking)  # the cases are right
    if Constraint("json_schema", text).problem() is not None:
        return
    grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    assert not any(grammar_accepts(grammar, dumps(value)) for value in breaking)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (NOT_UNIQUE, "json_schema keyword 'uniqueItems' at #: only false is enforced"),
        (
            {"type": "object", "properties": {"a/b": {"type": "array", "contains": INT}}},
            "json_schema keyword 'contains' at #/properties/a~1b is not supported",
        ),
        ({"allOf": [INT, {"minimum": 5}]}, "json_schema keyword 'allOf' at #: only one schema"),
        ({"$ref": "other.json#/x"}, "json_schema keyword '$ref' at #: 'other.json#/x' is not a"),
        ({"type": "string", "maxLength": -1}, "json_schema is not a valid JSON Schema: -1 is"),
        ({"oneOf": [INT, {"type": "number"}]}, "json_schema is not supported: oneOf with overl"),
        ({"maxLength": 3}, "json_schema keyword 'maxLength' at #: needs a 'type' naming string"),
    ],
)
def test_a_refusal_names_the_keyword_and_where_it_is(schema: Any, message: str) -> None:
    assert (Constraint("json_schema", json.dumps(schema)).problem() or "").startswith(message)


def test_schemas_of_the_supported_subset_are_accepted() -> None:
    tables = pq.read_table(ROOT / "jobs" / "demo" / "chat.parquet").column("json_schema")
    from batchrun.bench.workloads import RECORDS_SCHEMA

    schemas = [
        tables[0].as_py(),
        RECORDS_SCHEMA,
        json.dumps(
            {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "title": "pet",
                "$defs": {"tag": {"type": "string", "format": "uuid"}},
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "size": {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": 99},
                    "kind": {"type": "string", "enum": ["cat", "dog"]},
                    "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
                    "alt": {"anyOf": [{"type": "null"}, {"type": "number", "maximum": 1.5}]},
                    "pair": {"type": "array", "prefixItems": [INT, STR], "items": False},
                    "even": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 8},
                    "extra": {"type": "object", "additionalProperties": INT, "maxProperties": 2},
                },
                "required": ["name", "size"],
                "additionalProperties": False,
            }
        ),
    ]
    assert [Constraint("json_schema", s).problem() for s in schemas] == [None, None, None]


def test_the_docs_list_the_supported_subset() -> None:
    page = (ROOT / "docs" / "structured-outputs.md").read_text()
    markers = r"<!-- json-schema-support[^>]*-->\n(.*?)\n<!-- /json-schema-support -->"
    table = re.search(markers, page, re.S)
    assert table is not None and table.group(1) == support_table()


def test_xgrammar_warnings_become_refusals_and_never_reach_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with xgrammar_warnings() as warnings:
        xgrammar.Grammar.from_json_schema('{"type": "number", "multipleOf": 0.25}')
        os.write(2, b"another thread's line\n")  # written back, not taken for a warning
    assert warnings == ["multipleOf is not supported for type:number; ignoring multipleOf"]
    schema = '{"oneOf": [{"type": "integer"}, {"type": "number", "title": "warns"}]}'
    refused = [Constraint("json_schema", schema).problem(), Constraint("regex", "x$y").problem()]
    assert (refused[0] or "").startswith("json_schema is not supported: oneOf with overlapping")
    assert (refused[1] or "").startswith("regex is not supported: ")
    assert capfd.readouterr().err == "another thread's line\n"


# xgrammar's regex dialect against Python's: (regex, strings), each string's match the same.
DIALECT = [
    (".", ["\n", "\r", "\u2028", "é"]),
    (r"\d", ["5", "٣"]),
    (r"\D", ["٣", "5"]),
    (r"\w", ["é", "_", "a"]),
    (r"\W", ["é", "a"]),
    (r"\s", ["\xa0", "\ufeff", "\x1c", "\v", " "]),
    (r"\S", ["\xa0", "\x1c", "a"]),
    (r"[\s_]", ["\u3000", "_", "\x1c"]),
    (r"[^\s]", ["\xa0", "a"]),
    (r"[^a]", ["\n", "a"]),
    (r"(?<n>a)b", ["ab"]),
    (r"\e\cJ", ["\x1b\n"]),
    (r"[.[]", [".", "[", "a"]),
    (r"(ab){1,2}|c*", ["abab", "", "ccc", "abc"]),
]


@pytest.mark.parametrize(("regex", "strings"), DIALECT)
def test_the_check_reads_regexes_as_xgrammar_does(regex: str, strings: list[str]) -> None:
    assert regex_problem(regex) is None
    grammar = xgrammar.Grammar.from_regex(regex)
    checked = python_regex(regex, dot_all=True)
    for text in strings:
        assert (checked.fullmatch(text) is not None) == grammar_accepts(grammar, text), text


@pytest.mark.parametrize(
    ("constraint", "text", "why"),
    [
        (Constraint("json_schema", json.dumps(NOT_UNIQUE)), '["a", "a"]', "['a', 'a'] has non-"),
        (
            Constraint("json_schema", json.dumps({"properties": {"t": NOT_UNIQUE}})),
            '{"t": ["a", "a"]}',
            "['a', 'a'] has non-unique elements (at /t)",
        ),
        (Constraint("json_schema", '{"type": "integer"}'), '{"a": 1', "it is not JSON (Expecting"),
        (Constraint("json_schema", '{"type": "number"}'), "NaN", "it is not JSON (NaN is not a"),
        (Constraint("json_schema", '{"maxLength": 2}'), '"abc"', "'abc' is too long (at the top)"),
        (Constraint("json_schema", '{"type": "string", "pattern": "^a.b$"}'), '"a\\nb"', "'a\\n"),
        (Constraint("regex", "[a-z]{2}"), "abc", "it does not match the whole text"),
        (Constraint("choice", ("yes", "no")), "maybe", "'maybe' is not one of them"),
    ],
)
def test_the_check_says_why_a_completion_breaks_its_constraint(
    constraint: Constraint, text: str, why: str
) -> None:
    assert (violation(constraint, text) or "").startswith(why)


@pytest.mark.parametrize(
    ("constraint", "text"),
    [
        (Constraint("json_schema", json.dumps(NOT_UNIQUE)), '["a", "b"]'),
        (Constraint("json_schema", '{"type": "string", "pattern": "^\\\\D$"}'), '"٣"'),  # ECMA
        (Constraint("json_schema", '{"type": "string", "format": "email"}'), '"not one"'),
        (Constraint("regex", "a.b"), "a\nb"),
        (Constraint("choice", ("yes", "no")), "no"),
    ],
)
def test_a_completion_that_satisfies_its_constraint_passes_the_check(
    constraint: Constraint, text: str
) -> None:
    assert violation(constraint, text) is None


def finished(params: SamplingParams, text: str | None, reason: str = "stop") -> Request:
    output = RequestOutput([5, 6, 7], finish_reason=reason)
    request = Request(0, [1, 2], params, output=output)
    request.output.completion = text
    return request


REGEX = Constraint("regex", "(ab){3}")


@pytest.mark.parametrize(
    ("params", "text", "error"),
    [
        (SamplingParams(constraint=REGEX), "ababab", None),
        (SamplingParams(constraint=REGEX, max_tokens=3), "aba", None),  # length: not checked
        (SamplingParams(), "a", None),
        (
            SamplingParams(constraint=REGEX),
            "abab",
            "the completion breaks its regex: it does not match the whole text",
        ),
        (
            SamplingParams(constraint=REGEX, stop=("ba",)),
            "a",
            "a stop string cut the completion before its regex was met: it does not match",
        ),
        (
            SamplingParams(constraint=REGEX, stop=("ba",), stop_token_ids=(7,)),
            "aba",
            "stop token id 7 cut the completion before its regex was met: it does not match",
        ),
    ],
)
def test_a_stop_row_that_breaks_its_constraint_keeps_its_completion_and_says_why(
    params: SamplingParams, text: str, error: str | None
) -> None:
    reason = "length" if params.max_tokens == 3 else "stop"
    row = finished_row(finished(params, text, reason))
    assert (row.completion, row.finish_reason, row.completion_tokens) == (text, reason, 3)
    assert (row.error or "").startswith(error or "") and (row.error is None) == (error is None)


def test_a_row_that_ends_inside_its_think_block_has_no_answer_to_hold() -> None:
    class NoAnswer:
        def split(self, request: Request) -> tuple[str, None, int]:
            return request.output.completion or "", None, 3

    row = finished_row(finished(SamplingParams(constraint=REGEX), "thinking"), NoAnswer())  # type: ignore[arg-type]
    assert row.error == (
        "the completion breaks its regex: the row ended inside its think block, before any answer"
    )


def test_struct_cells_leave_their_null_fields_out() -> None:
    cell = {
        "type": "object",
        "maxLength": None,
        "properties": {"a": {"type": "string", "enum": None}},
        "enum": [None, {"x": None}],
    }
    assert without_nulls(cell) == {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "enum": [None, {}],
    }
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    vocab = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    field = pa.struct([("type", pa.string()), ("maxLength", pa.int64())])
    batch = pa.RecordBatch.from_pydict(
        {"prompt": ["x"], "json_schema": pa.array([{"type": "string", "maxLength": None}], field)}
    )
    job = JobSpec.from_keys(dict(input="in", output="out", target=str(TARGET)))
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    builder = RequestBuilder(
        job.row_defaults(),
        PromptColumn(PromptKind.TEXT, "prompt"),
        batch.schema,
        tokenizer,
        64,
        vocab,
        lambda: grammars,
    )
    ((_, request),) = builder.build_batch(batch, [0])
    assert isinstance(request, Request), request
    assert request.params.constraint == Constraint("json_schema", '{"type": "string"}')


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def test_a_job_key_the_grammar_would_not_enforce_refuses_validate_and_run(
    tmp_path: Path, tiny_model: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "in" / "rows.parquet")
    base = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    base += ["--target", str(tiny_model), "--quiet"]
    cases = [
        (json.dumps(NOT_UNIQUE), "job key 'json_schema': json_schema keyword 'uniqueItems' at #"),
        (
            '{"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "a$b"}]}',
            "job key 'json_schema': json_schema is not supported: ",
        ),
    ]
    for schema, message in cases:
        for command in ("validate", "run"):
            result = invoke(command, *base, "--json-schema", schema)
            assert result.exit_code == 2, result.output
            lines = result.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"batchrun: error: {message}"), lines
    assert "Warning" not in capfd.readouterr().err  # xgrammar's own lines never reach stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(JobError, match=r"^job key 'regex': regex is not supported: "):
        JobSpec.from_keys(dict(input="in", output="out", target="t", regex="a^b"))


def test_validate_lists_constraint_columns_as_per_row_settings(
    tmp_path: Path, tiny_model: Path
) -> None:
    (tmp_path / "in").mkdir()
    table = pa.table(
        {
            "prompt": ["a"],
            "max_tokens": [3],
            "json_schema": ['{"type": "string"}'],
            "regex": pa.array([None], pa.string()),
            "choice": [["x"]],
            "note": ["n"],
        }
    )
    pq.write_table(table, tmp_path / "in" / "rows.parquet")
    flags = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    result = invoke("validate", *flags, "--target", str(tiny_model))
    assert result.exit_code == 0, result.output
    assert "per-row overrides: max_tokens, json_schema, regex, choice\n" in result.output
    assert "pass-through columns: note\n" in result.output


def run_rows(tmp_path: Path, draft: Path | None, columns: dict[str, list[Any]]) -> list[dict]:
    """A job over the demo target with these input columns; its output rows in row order."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    rows = len(next(iter(columns.values())))
    pq.write_table(
        pa.table({"prompt": ["def f(x):\n    return "] * rows, **columns}), inputs / "rows.parquet"
    )
    spec = JobSpec.from_keys(
        dict(
            input=str(inputs),
            output=str(tmp_path / "out"),
            target=str(TARGET),
            draft=str(draft) if draft else None,
            max_tokens=48,
            device="cpu",
            dtype="float32",
            quiet=True,
        )
    )
    run_job(spec)
    return pl.read_parquet(tmp_path / "out" / "*.parquet").sort("row_index").to_dicts()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("draft", [None, DRAFT], ids=["plain", "drafted"])
def test_stop_rows_satisfy_their_constraints_or_say_why(tmp_path: Path, draft: Path | None) -> None:
    pair = json.dumps({"const": {"a": [1, 2]}})  # the grammar writes {"a":[1,2]}, whatever
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = json.dumps({"type": "object", "properties": {"n": digit}, "required": ["n"]})
    out = run_rows(
        tmp_path,
        draft,
        {
            "json_schema": [pair, schema, json.dumps(NOT_UNIQUE), None, None],
            "regex": [None, None, None, "(ab){3}", "(ab){3}"],
            "stop": [[","], None, None, ["ba"], None],
        },
    )
    cut = "a stop string cut the completion before its"
    assert (out[0]["completion"], out[0]["finish_reason"]) == ('{"a":[1', "stop")
    assert out[0]["error"].startswith(f"{cut} json_schema was met: it is not JSON (")
    assert out[1]["error"] is None and out[1]["finish_reason"] == "stop"
    assert 0 <= json.loads(out[1]["completion"])["n"] <= 9
    assert out[2]["error"].startswith("json_schema keyword 'uniqueItems' at #: only false")
    assert (out[2]["completion"], out[2]["finish_reason"]) == (None, "error")
    assert (out[3]["completion"], out[3]["finish_reason"]) == ("a", "stop")
    assert out[3]["error"] == f"{cut} regex was met: it does not match the whole text"
    assert (out[4]["completion"], out[4]["error"]) == ("ababab", None)
