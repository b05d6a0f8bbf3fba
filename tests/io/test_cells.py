"""No input cell can stop a job: each bad cell becomes its own row's error, or a start-up refusal.

Unit tests hold RequestBuilder and the cell reader to their rules; end-to-end tests run
`batchrun run` on the tiny model over Parquet files with the hostile cells written in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.io.input.cells import BadCell, row_values
from batchrun.io.input.prompt_bound import longest_token_chars
from batchrun.io.input.prompts import RequestBuilder, find_prompt_column
from batchrun.io.input.reader import open_input

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
CONTEXT = 64
VOCAB = 500


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def make_job(**keys: Any) -> JobSpec:
    return JobSpec.from_keys(dict(**{"input": "in", "output": "out", "target": "model", **keys}))


def builder_for(
    tokenizer: PreTrainedTokenizerBase, columns: dict[str, pa.DataType], **keys: Any
) -> RequestBuilder:
    schema = pa.schema(list(columns.items()))
    job = make_job(**keys)
    return RequestBuilder(
        job.row_defaults(), find_prompt_column(schema, job.input), schema, tokenizer, CONTEXT, VOCAB
    )


def not_utf8(values: Sequence[bytes | None]) -> pa.Array:
    """A string array holding the given bytes, valid UTF-8 or not (cast without validation)."""
    return pa.array(values, pa.binary()).cast(pa.string(), safe=False)


# -- huge integers: seed, top_k, max_tokens ------------------------------------------------------


def test_seed_accepts_the_contract_range_modulo_2_64(tokenizer: PreTrainedTokenizerBase) -> None:
    builder = builder_for(tokenizer, {"prompt": pa.string(), "seed": pa.uint64()})
    for cell, seed in [(-1, 2**64 - 1), (-(2**63), 2**63), (2**63, 2**63), (2**64 - 1, 2**64 - 1)]:
        request = builder.build(0, {"prompt": "x", "seed": cell})
        assert isinstance(request, Request) and request.params.seed == seed
    for bad in (2**64, -(2**63) - 1, 1e30):
        error = builder.build(0, {"prompt": "x", "seed": bad})
        assert isinstance(error, str)
        assert error.startswith("seed must be an integer in [-2^63, 2^64)")


def test_top_k_beyond_the_vocabulary_is_off_and_negative_is_an_error(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    builder = builder_for(tokenizer, {"prompt": pa.string(), "top_k": pa.uint64()})
    for cell, top_k in [(2**63, 0), (2**64 - 1, 0), (VOCAB, 0), (VOCAB - 1, VOCAB - 1), (3, 3)]:
        request = builder.build(0, {"prompt": "x", "top_k": cell})
        assert isinstance(request, Request) and request.params.top_k == top_k
    error = builder.build(0, {"prompt": "x", "top_k": -1})
    assert isinstance(error, str) and error.startswith("top_k must be an integer >= 0")


def test_job_level_top_k_beyond_the_vocabulary_is_off(tokenizer: PreTrainedTokenizerBase) -> None:
    request = builder_for(tokenizer, {"prompt": pa.string()}, top_k=2**70).build(0, {"prompt": "x"})
    assert isinstance(request, Request) and request.params.top_k == 0


def test_job_level_seed_outside_the_contract_range_is_refused(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    with pytest.raises(
        JobError, match="job key 'seed': .* greater than the maximum of 18446744073709551615"
    ):
        builder_for(tokenizer, {"prompt": pa.string()}, seed=2**64)
    with pytest.raises(
        JobError, match="job key 'seed': .* less than the minimum of -9223372036854775808"
    ):
        builder_for(tokenizer, {"prompt": pa.string()}, seed=-(2**63) - 1)


# -- float32: top_p and temperature --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("top_p", 5e-324, "top_p must be in (0, 1], got 5e-324 (0 in float32)"),
        ("top_p", 1e-46, "top_p must be in (0, 1], got 1e-46 (0 in float32)"),
        ("top_p", math.nan, "top_p must be in (0, 1]"),
        ("temperature", math.inf, "temperature must be a finite number >= 0"),
        ("temperature", 1e39, "temperature must be a finite number >= 0, got 1e+39 (inf in"),
        ("temperature", -1e-30, "temperature must be a finite number >= 0"),
    ],
)
def test_float_checks_hold_for_the_float32_value(
    tokenizer: PreTrainedTokenizerBase, name: str, value: float, error: str
) -> None:
    builder = builder_for(tokenizer, {"prompt": pa.string(), name: pa.float64()})
    result = builder.build(0, {"prompt": "x", name: value})
    assert isinstance(result, str) and result.startswith(error), result
    # The job's own key is refused at start-up: by this rule, or by the schema where it can.
    with pytest.raises(JobError, match=rf"job( sampling default: {name} must be| key .{name}.)"):
        builder_for(tokenizer, {"prompt": pa.string()}, **{name: value})


def test_temperatures_below_1e_5_are_greedy(tokenizer: PreTrainedTokenizerBase) -> None:
    builder = builder_for(tokenizer, {"prompt": pa.string(), "temperature": pa.float64()})
    for cell, temperature in [(5e-324, 0.0), (1e-40, 0.0), (1e-30, 0.0), (9.99e-6, 0.0)]:
        request = builder.build(0, {"prompt": "x", "temperature": cell})
        assert isinstance(request, Request) and request.params.temperature == temperature
    for cell in (1e-5, 0.7, 1e30):
        request = builder.build(0, {"prompt": "x", "temperature": cell})
        assert isinstance(request, Request) and request.params.temperature == cell
    job_level = builder_for(tokenizer, {"prompt": pa.string()}, temperature=1e-300)
    request = job_level.build(0, {"prompt": "x"})
    assert isinstance(request, Request) and request.params.temperature == 0.0


# -- cells that are not valid UTF-8, or cannot become Python values at all ------------------------


def test_a_bad_cell_spoils_only_its_own_row() -> None:
    batch = pa.record_batch(
        {
            "prompt": not_utf8([b"ok", b"\xff\xfe", None]),
            "stop": pa.array([[b"a"], [b"b"], [b"\xc3("]], pa.list_(pa.binary())).cast(
                pa.list_(pa.string()), safe=False
            ),
            "messages": pa.array(
                [[{"role": b"user", "content": b"\xe2\x82"}], [], None],
                pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())])),
            ).cast(MESSAGES, safe=False),
        }
    )
    rows = row_values(batch, ["prompt", "stop", "messages"])
    bad = BadCell("is not valid UTF-8")
    assert rows == [
        {"prompt": "ok", "stop": ["a"], "messages": bad},
        {"prompt": bad, "stop": ["b"], "messages": []},
        {"prompt": None, "stop": bad, "messages": None},
    ]


def test_bad_cells_become_error_rows(tokenizer: PreTrainedTokenizerBase) -> None:
    bad = BadCell("is not valid UTF-8")
    text = builder_for(tokenizer, {"prompt": pa.string(), "stop": pa.list_(pa.string())})
    assert text.build(0, {"prompt": bad, "stop": None}) == "prompt is not valid UTF-8"
    assert text.build(0, {"prompt": "x", "stop": bad}) == "stop is not valid UTF-8"
    chat = builder_for(tokenizer, {"messages": MESSAGES})
    assert chat.build(0, {"messages": bad}) == "messages is not valid UTF-8"


# -- duplicate column names ---------------------------------------------------------------------


def test_duplicate_column_names_are_refused_at_start_up(tmp_path: Path) -> None:
    table = pa.Table.from_arrays(
        [pa.array(["a"]), pa.array([1]), pa.array([2])], names=["prompt", "seed", "seed"]
    )
    pq.write_table(table, tmp_path / "in.parquet")
    with pytest.raises(JobError, match="column 'seed' more than once"):
        open_input(str(tmp_path / "in.parquet"))


# -- the cheap length bound before tokenizing ----------------------------------------------------


def test_longest_token_counts_added_special_tokens(tokenizer_dir: Path) -> None:
    fresh = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    plain = longest_token_chars(fresh)
    long_token = "<|" + "x" * (plain + 10) + "|>"
    fresh.add_special_tokens({"additional_special_tokens": [long_token]})
    assert longest_token_chars(fresh) == len(long_token)
    assert len(fresh.encode(long_token * 5)) == 5  # five tokens of len(long_token) characters


def test_the_bound_is_below_the_token_count(tokenizer: PreTrainedTokenizerBase) -> None:
    longest = longest_token_chars(tokenizer)
    vocab = list(tokenizer.get_vocab())
    pieces = [tokenizer.convert_tokens_to_string([token]) for token in vocab]
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 200)))
        assert -(-len(text) // longest) <= len(tokenizer.encode(text))


def test_a_prompt_the_bound_refuses_is_not_tokenized(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    longest = longest_token_chars(tokenizer)
    encoded: list[int] = []
    real_encode = tokenizer.encode

    def encode(text: str) -> list[int]:
        encoded.append(len(text))
        return []

    monkeypatch.setattr(tokenizer, "encode", encode)
    builder = builder_for(tokenizer, {"prompt": pa.string()})
    huge = "a" * 2_000_000
    at_bound = "a" * (CONTEXT * longest)
    for text, tokens in ((huge, -(-len(huge) // longest)), (at_bound, CONTEXT)):
        error = builder.build(0, {"prompt": text})
        assert error == (
            f"prompt is too long: at least {tokens} tokens ({len(text)} characters); "
            "the model's context is 64"
        )
    assert encoded == []
    monkeypatch.setattr(tokenizer, "encode", real_encode)
    error = builder.build(0, {"prompt": "a " * (CONTEXT * 2)})  # under the bound: tokenized
    assert error == f"prompt is too long: {len(real_encode('a ' * CONTEXT * 2))} tokens; " + (
        "the model's context is 64"
    )


def test_chat_and_token_id_prompts_are_bounded_before_their_cells_are_read(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    longest = longest_token_chars(tokenizer)
    rendered: list[Any] = []
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: rendered.append(a))
    chat = builder_for(tokenizer, {"messages": MESSAGES})
    half = "b" * (CONTEXT * longest // 2)
    messages = [{"role": "user", "content": half}, {"role": "assistant", "content": half}]
    error = chat.build(0, {"messages": messages})
    assert isinstance(error, str) and error.startswith("prompt is too long: at least 64 tokens")
    assert rendered == []
    ids = builder_for(tokenizer, {"prompt_token_ids": pa.list_(pa.int64())})
    error = ids.build(0, {"prompt_token_ids": [10**30] * CONTEXT})
    assert error == "prompt is too long: 64 tokens; the model's context is 64"


# -- a tokenizer that raises --------------------------------------------------------------------


class PanicException(BaseException):
    """Named like the exception a Rust tokenizer's panic raises (a BaseException)."""


@pytest.mark.parametrize("exception", [ValueError("odd input"), PanicException("odd input")])
def test_a_tokenizer_that_raises_fails_only_that_row(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, exception: BaseException
) -> None:
    def encode(text: str) -> list[int]:
        raise exception

    monkeypatch.setattr(tokenizer, "encode", encode)
    builder = builder_for(tokenizer, {"prompt": pa.string()})
    assert builder.build(0, {"prompt": "x"}) == "tokenization failed: odd input"


def test_interrupts_from_the_tokenizer_still_stop_the_job(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    def encode(text: str) -> list[int]:
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "encode", encode)
    with pytest.raises(KeyboardInterrupt):
        builder_for(tokenizer, {"prompt": pa.string()}).build(0, {"prompt": "x"})


# -- end to end: `batchrun run` over hostile Parquet ---------------------------------------------


def run_job(tmp_path: Path, model: Path, table: pa.Table, extra: str = "") -> Result:
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "in.parquet")
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{model}"\n'
        f"max_tokens = 3\nmax_batch_size = 8\n{extra}"
    )
    return CliRunner().invoke(cli, ["run", str(job)])


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")


def test_uint64_cells_do_not_stop_the_job(tmp_path: Path, make_model: Any) -> None:
    model = make_model(max_position_embeddings=24)
    huge = [2**63, 2**64 - 1, 0, None]
    table = pa.table(
        {
            "prompt": ["def f(x):", "import os", "class A:", "x = 1"],
            "seed": pa.array(huge, pa.uint64()),
            "top_k": pa.array([2**64 - 1, 5, 2**63, None], pa.uint64()),
            "max_tokens": pa.array([2**63, 2, 2**64 - 1, None], pa.uint64()),
            "temperature": [0.0, 0.8, 0.8, 0.0],
        }
    )
    result = run_job(tmp_path, model, table, "quiet = true\n")
    assert result.exit_code == 0, result.output
    out = read_output(tmp_path / "out")
    assert out.column("error").to_pylist() == [None] * 4
    assert "error" not in out.column("finish_reason").to_pylist()
    # max_tokens 2^63 is capped by the context: the completion fills it.
    assert out.column("prompt_tokens")[0].as_py() + out.column("completion_tokens")[0].as_py() == 24


def test_invalid_utf8_fails_only_its_row_and_passes_through(
    tmp_path: Path, tiny_model: Path
) -> None:
    note = [b"fine", b"ok", b"\xff\xfe", b"n\xc3"]
    table = pa.table(
        {
            "prompt": not_utf8([b"def f(x):", b"\xc3(", b"import os", b"x = 1"]),
            "stop": pa.array([None, None, None, [b"\xe2\x82"]], pa.list_(pa.binary())).cast(
                pa.list_(pa.string()), safe=False
            ),
            "note": not_utf8(note),
        }
    )
    result = run_job(tmp_path, tiny_model, table, 'id_column = "note"\n')
    assert result.exit_code == 0, result.output
    out = read_output(tmp_path / "out")
    replaced = "invalid UTF-8 replaced with U+FFFD in the output"
    assert out.column("error").to_pylist() == [
        None,
        f"prompt is not valid UTF-8; {replaced}: prompt (original bytes in prompt__raw_bytes)",
        f"{replaced}: note (original bytes in note__raw_bytes)",
        f"stop is not valid UTF-8; {replaced}: stop, note "
        "(original bytes in stop__raw_bytes, note__raw_bytes)",
    ]
    # The output is valid UTF-8; the original bytes of the replaced cells are kept beside it.
    assert out.column("note").to_pylist() == [b.decode("utf-8", "replace") for b in note]
    assert out.column("note__raw_bytes").to_pylist() == [None, None, *note[2:]]
    assert "row 3 (note=<is not valid UTF-8>): stop is not valid UTF-8" in result.stderr


def test_validate_refuses_duplicate_columns_in_one_line(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "in").mkdir()
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["prompt", "prompt"])
    pq.write_table(table, tmp_path / "in" / "in.parquet")
    job = tmp_path / "job.toml"
    job.write_text(f'input = "in"\noutput = "out"\ntarget = "{tiny_model}"\n')
    for command in ("validate", "run"):
        result = CliRunner().invoke(cli, [command, str(job)])
        assert result.exit_code == 2, result.output
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "column 'prompt' more than once" in lines[0], result.stderr
