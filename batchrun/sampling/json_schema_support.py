"""The JSON Schema subset batchrun holds completions to: the keywords xgrammar 0.2.9 enforces.

Found by experiment: a schema with the keyword compiled (Grammar.from_json_schema, as rows
compile), a matcher walked over a JSON text that breaks it; where the matcher accepts that text,
the keyword is not enforced. xgrammar compiles such schemas all the same (uniqueItems, contains,
not, if/then/else, dependentRequired, patternProperties, a remote $ref, the keywords beside an
anyOf or a $ref: silently; multipleOf on numbers, an allOf of several, an overlapping oneOf: with a
warning on stderr), so a completion could finish `stop` and break its schema. batchrun refuses
such a schema instead, naming the keyword and where it is; also a schema JSON Schema itself
rejects (jsonschema's check_schema: a maxLength of -1), and one xgrammar warns about.

SUPPORTED is the one declaration of the subset: the refusal reads it, and so does the docs' table
(support_table; a test holds docs/structured-outputs.md to it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

from batchrun.sampling.xgrammar_warnings import xgrammar_warnings

# The drafts a schema's $schema may name (none: 2020-12); another's keywords mean other things.
DRAFTS: tuple[type[Validator], ...] = (
    jsonschema.Draft202012Validator,
    jsonschema.Draft201909Validator,
    jsonschema.Draft7Validator,
    jsonschema.Draft6Validator,
)
_DRAFT_NAMES = ", ".join(
    re.search(r"draft[/-]0?(\d+(?:-\d+)?)", d.ID_OF(d.META_SCHEMA)).group(1)  # type: ignore[union-attr]
    for d in DRAFTS
)
# The `format`s whose strings xgrammar's grammar holds to the format (others it lets be anything).
FORMATS = (
    "date",
    "date-time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "json-pointer",
    "relative-json-pointer",
    "time",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
)

Check = Callable[[Any, dict[str, Any], Validator], str | None]


@dataclass(frozen=True)
class Keyword:
    """What batchrun accepts of one keyword."""

    types: tuple[str, ...] = ()  # the instance types it constrains: `type` must name one
    role: str = "validation"  # or "annotation" (constrains nothing), "definitions" ($defs)
    holds: str = ""  # subschemas: "schema", "schemas" (a list), "named" (name -> schema)
    alone: bool = False  # xgrammar ignores the validation keywords beside it: none may be
    top_only: bool = False  # only in the schema at the top
    check: Check | None = None  # its other limits: why its value cannot be held to, or None
    note: str = ""  # its limits, for the table


def _one_schema(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    return None if len(value) == 1 else "only one schema is enforced (merge them into one)"


def _local(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    if value == "#" or value.startswith("#/"):
        return None
    return f"{value!r} is not a reference within the schema (# or #/...)"


def _declared(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    missing = [name for name in value if name not in node.get("properties", {})]
    return f"{missing[0]!r} is not in properties" if missing else None


def _names(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    checker = validator.evolve(schema=value)
    broken = [name for name in node.get("properties", {}) if not checker.is_valid(name)]
    return f"property {broken[0]!r} breaks it" if broken else None


def _a_schema(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    return None if isinstance(value, (dict, bool)) else "a list of schemas: use prefixItems"


def _false(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    return None if value is False else "only false is enforced"


def _free_length(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    beside = [key for key in ("pattern", "format") if key in node]
    return f"not enforced beside {beside[0]}" if beside else None


def _whole(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    if not (isinstance(value, int) or float(value).is_integer()):
        return "only a whole number is enforced"
    if "number" in _types(node):
        return "enforced for integers only, not numbers"
    lower = {"minimum", "exclusiveMinimum"} & node.keys()
    upper = {"maximum", "exclusiveMaximum"} & node.keys()
    if bool(lower) != bool(upper):
        return "not enforced with one bound: give both or neither"
    return None


def _format(value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    return None if value in FORMATS else f"{value!r} is not a format the grammar holds to"


STRING, NUMBER, ARRAY, OBJECT = ("string",), ("integer", "number"), ("array",), ("object",)
_ANNOTATION = Keyword(role="annotation", note="annotations")
_TOP = "the top schema only"
_ALONE = "nothing but annotations beside it"

SUPPORTED: dict[str, Keyword] = {
    "type": Keyword(note="a type or a list of them"),
    "enum": Keyword(note="its values must satisfy the keywords beside it"),
    "const": Keyword(note="its value must satisfy the keywords beside it"),
    "anyOf": Keyword(holds="schemas", alone=True, note=_ALONE),
    "oneOf": Keyword(holds="schemas", alone=True, note=f"{_ALONE}; provably disjoint branches"),
    "allOf": Keyword(holds="schemas", alone=True, check=_one_schema, note=f"{_ALONE}; one schema"),
    "$ref": Keyword(alone=True, check=_local, note=f"{_ALONE}; within the schema: # or #/..."),
    "$defs": Keyword(role="definitions", holds="named"),
    "definitions": Keyword(role="definitions", holds="named"),
    "properties": Keyword(OBJECT, holds="named", note="written in their order"),
    "required": Keyword(OBJECT, check=_declared, note="names in properties"),
    "additionalProperties": Keyword(OBJECT, holds="schema", note="absent: no other properties"),
    "unevaluatedProperties": Keyword(OBJECT, holds="schema"),
    "propertyNames": Keyword(OBJECT, holds="schema", check=_names, note="properties obey it"),
    "minProperties": Keyword(OBJECT),
    "maxProperties": Keyword(OBJECT),
    "items": Keyword(ARRAY, holds="schema", check=_a_schema, note="a schema, not a list"),
    "prefixItems": Keyword(ARRAY, holds="schemas"),
    "unevaluatedItems": Keyword(ARRAY, holds="schema"),
    "minItems": Keyword(ARRAY),
    "maxItems": Keyword(ARRAY),
    "uniqueItems": Keyword(ARRAY, check=_false, note="false only"),
    "minLength": Keyword(STRING, check=_free_length, note="not beside pattern or format"),
    "maxLength": Keyword(STRING, check=_free_length, note="not beside pattern or format"),
    "pattern": Keyword(STRING, note="matches the whole string"),
    "format": Keyword(STRING, check=_format, note=", ".join(FORMATS)),
    "minimum": Keyword(NUMBER),
    "maximum": Keyword(NUMBER),
    "exclusiveMinimum": Keyword(NUMBER),
    "exclusiveMaximum": Keyword(NUMBER),
    "multipleOf": Keyword(
        NUMBER, check=_whole, note="integers: a whole number, with both bounds or neither"
    ),
    "title": _ANNOTATION,
    "description": _ANNOTATION,
    "default": _ANNOTATION,
    "examples": _ANNOTATION,
    "$comment": _ANNOTATION,
    "deprecated": _ANNOTATION,
    "readOnly": _ANNOTATION,
    "writeOnly": _ANNOTATION,
    "$schema": Keyword(role="annotation", top_only=True, note=f"{_TOP}; drafts {_DRAFT_NAMES}"),
    "$id": Keyword(role="annotation", top_only=True, note=_TOP),
}


@functools.lru_cache(maxsize=128)
def json_schema_problem(text: str) -> str | None:
    """Why a json_schema constraint (its JSON text) cannot be held to, or None: it can, or it
    does not compile (compiling says why)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        return f"json_schema is not JSON: {exc}"
    except RecursionError:
        return "json_schema nests too deeply to be checked"
    try:
        return _schema_problem(schema) or _warned(text)
    except RecursionError:
        return "json_schema nests too deeply to be checked"


def validator_class(schema: Any) -> type[Validator] | None:
    """The validator of the draft the schema's $schema names (none: 2020-12); None when it
    names another."""
    if not (isinstance(schema, dict) and "$schema" in schema):
        return DRAFTS[0]
    named = str(schema["$schema"]).rstrip("#")
    return next((d for d in DRAFTS if d.ID_OF(d.META_SCHEMA).rstrip("#") == named), None)


def support_table() -> str:
    """The docs' table of SUPPORTED: keywords of one kind and limits share a row."""
    rows: list[tuple[list[str], Keyword]] = []
    for name, keyword in SUPPORTED.items():
        if rows and _row_key(rows[-1][1]) == _row_key(keyword):
            rows[-1][0].append(name)
        else:
            rows.append(([name], keyword))
    lines = ["| keywords | of | limits |", "|---|---|---|"]
    for names, keyword in rows:
        of = " or ".join(keyword.types) or "any"
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {of} | {keyword.note or '-'} |")
    return "\n".join(lines)


def _row_key(keyword: Keyword) -> tuple[Any, ...]:
    return keyword.types, keyword.note


def _schema_problem(schema: Any) -> str | None:
    validator_type = validator_class(schema)
    if validator_type is None:
        return f"json_schema's $schema {schema['$schema']!r} names none of drafts {_DRAFT_NAMES}"
    try:
        validator_type.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _where(exc.absolute_path)
        return f"json_schema is not a valid JSON Schema: {exc.message} at {where}"
    return _walk(schema, [], validator_type(schema))


def _walk(node: Any, path: list[str], validator: Validator) -> str | None:
    """The first keyword of the schema at `path` (or of one under it) that cannot be held to."""
    if not isinstance(node, dict):
        return None  # true or false
    where = _where(path)
    for key in node:
        keyword = SUPPORTED.get(key)
        if keyword is None:
            why = "the grammar would not enforce it"
            return f"json_schema keyword {key!r} at {where} is not supported ({why})"
        if keyword.top_only and path:
            return f"json_schema keyword {key!r} at {where} is supported in the top schema only"
    for key, value in node.items():
        reason = _limit(key, value, node, validator)
        if reason is not None:
            return f"json_schema keyword {key!r} at {where}: {reason}"
    for key, value in node.items():
        holds = SUPPORTED[key].holds
        subschemas: Sequence[tuple[list[str], Any]] = []
        if holds == "schema":
            subschemas = [([key], value)]
        elif holds == "schemas":
            subschemas = [([key, str(i)], sub) for i, sub in enumerate(value)]
        elif holds == "named":
            subschemas = [([key, name], sub) for name, sub in value.items()]
        for steps, sub in subschemas:
            problem = _walk(sub, [*path, *steps], validator)
            if problem is not None:
                return problem
    return None


def _limit(key: str, value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    keyword = SUPPORTED[key]
    if keyword.alone:
        beside = [k for k in node if k != key and SUPPORTED[k].role == "validation"]
        if beside:
            return f"xgrammar ignores {beside[0]!r} beside it; put the keywords in its schemas"
    if key in ("enum", "const"):
        return _values_beside(key, value, node, validator)
    if "enum" in node or "const" in node:
        return None  # the grammar writes the values: the keywords beside them are checked so
    if keyword.types and not set(keyword.types) & set(_types(node)):
        if "type" not in node:
            types = " or ".join(keyword.types)
            return f"needs a 'type' naming {types}: xgrammar applies it only then"
        return None  # a keyword for other types: it has nothing to constrain
    return keyword.check(value, node, validator) if keyword.check is not None else None


def _values_beside(key: str, value: Any, node: dict[str, Any], validator: Validator) -> str | None:
    """enum and const: xgrammar writes their values and ignores the keywords beside them, so
    every value must satisfy those."""
    beside = {k: v for k, v in node.items() if k != key and SUPPORTED[k].role == "validation"}
    if not beside:
        return None
    checker = validator.evolve(schema=beside)
    for item in value if key == "enum" else [value]:
        if not checker.is_valid(item):
            shown = json.dumps(item)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            return f"{shown} breaks the keywords beside it ({', '.join(beside)})"
    return None


def _types(node: dict[str, Any]) -> list[str]:
    declared = node.get("type", [])
    return [declared] if isinstance(declared, str) else list(declared)


def _where(path: Sequence[Any]) -> str:
    """A location as a JSON Pointer fragment: # is the top."""
    return "#" + "".join("/" + str(step).replace("~", "~0").replace("/", "~1") for step in path)


def _warned(text: str) -> str | None:
    """The first warning xgrammar gives while it turns the schema into a grammar (of what it
    will not enforce), or None; a schema it cannot turn is left to compiling to report."""
    import xgrammar

    with xgrammar_warnings() as warnings:
        try:  # as Grammars.compile does: no free whitespace
            xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
        except RuntimeError:
            return None
    return f"json_schema is not supported: {warnings[0]}" if warnings else None
