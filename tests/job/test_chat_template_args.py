"""Chat template arguments and the reasoning split (issue 23, parts 1 and 2): the job key
chat_template_kwargs, the --thinking shorthand and a row's chat_template_kwargs column reach the
template, on a tiny model whose template has Qwen3's enable_thinking switch (thinking by default;
off, an empty think block); --reasoning-parser qwen3 splits the think block from the answer;
--max-thinking-tokens forces its end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.io.input.prompts import template_thinks
from batchrun.io.output.reasoning import ReasoningSplit
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.job.test_cli import assert_one_line_error, invoke, read_output, write_job

pytestmark = pytest.mark.usefixtures("one_thread_module")

# Qwen3's generation prompt, as its template writes it: thinking unless enable_thinking is false.
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
HELLO = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def thinking_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Qwen3-style template."""
    out = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = QWEN3_STYLE
    tokenizer.save_pretrained(str(out))
    return out


def rendered_length(model: Path, **kwargs: Any) -> int:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.apply_chat_template(
        HELLO, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    return len(ids)


def write_chats(directory: Path, kwargs_cells: list[Any] | None = None) -> None:
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    count = len(kwargs_cells) if kwargs_cells is not None else 2
    columns: dict[str, Any] = {"messages": pa.array([HELLO] * count, messages)}
    if kwargs_cells is not None:
        columns["chat_template_kwargs"] = pa.array(kwargs_cells, pa.string())
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), directory / "chats.parquet")


def test_the_probe_tells_a_thinking_template(thinking_model: Path, tiny_model: Path) -> None:
    assert template_thinks(AutoTokenizer.from_pretrained(str(thinking_model))) is True
    assert template_thinks(AutoTokenizer.from_pretrained(str(tiny_model))) is None  # no switch


def test_thinking_off_by_flag_key_or_row(tmp_path: Path, thinking_model: Path) -> None:
    thinking = rendered_length(thinking_model)
    off = rendered_length(thinking_model, enable_thinking=False)
    assert off > thinking  # the empty think block
    job = write_job(tmp_path, thinking_model, max_tokens=2)
    cells = [None, json.dumps({"enable_thinking": False}), "[1]", "{not json", '{"tokenize": 1}']
    write_chats(tmp_path / "in", cells)

    assert invoke("run", str(job)).exit_code == 0
    rows = read_output(tmp_path / "out").to_pylist()
    assert [r["prompt_tokens"] for r in rows[:2]] == [thinking, off]  # the template's default
    assert rows[2]["error"] == "chat_template_kwargs must be a JSON object"
    assert rows[3]["error"].startswith("chat_template_kwargs is not JSON")
    assert "'tokenize' is set by batchrun" in rows[4]["error"]

    # --no-thinking for the job: a row without a cell of its own renders without thinking.
    result = invoke("run", str(job), "--no-thinking", "--output", str(tmp_path / "off"))
    assert result.exit_code == 0, result.output
    assert read_output(tmp_path / "off").column("prompt_tokens").to_pylist()[:2] == [off, off]
    # The same as a job key; a row's own arguments go over the job's.
    write_chats(tmp_path / "in2", [json.dumps({"enable_thinking": True}), None])
    keyed = write_job(
        tmp_path, thinking_model, "chat_template_kwargs = {enable_thinking = false}\n"
    )
    result = invoke(
        "run", str(keyed), "--input", str(tmp_path / "in2"), "--output", str(tmp_path / "keyed")
    )
    assert result.exit_code == 0, result.output
    assert read_output(tmp_path / "keyed").column("prompt_tokens").to_pylist() == [thinking, off]


def test_a_different_thinking_is_a_different_job(tmp_path: Path, thinking_model: Path) -> None:
    job = write_job(tmp_path, thinking_model, max_tokens=2)
    write_chats(tmp_path / "in")
    assert invoke("run", str(job), "--no-thinking").exit_code == 0
    assert_one_line_error(invoke("run", str(job)), "different job")


def test_validate_says_whether_the_template_thinks(tmp_path: Path, thinking_model: Path) -> None:
    write_chats(tmp_path / "in")
    job = str(write_job(tmp_path, thinking_model))
    assert "a chat template that thinks by default" in invoke("validate", job).output
    assert "this job: thinking off" in invoke("validate", job, "--no-thinking").output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chat-template-kwargs", "{nope"], "not JSON"),
        (["--chat-template-kwargs", "[1]"], "expected a JSON object"),
        (["--chat-template-kwargs", '{"add_generation_prompt": false}'], "set by batchrun"),
    ],
)
def test_bad_template_arguments_refuse_the_job(
    tmp_path: Path, thinking_model: Path, args: list[str], message: str
) -> None:
    write_chats(tmp_path / "in")
    job = str(write_job(tmp_path, thinking_model))
    for command in ("validate", "run"):
        assert_one_line_error(invoke(command, job, *args), message)


# -- the reasoning split (issue 23, part 2) -------------------------------------------------

# A thinking-only template (Qwen3-2507's): the generation prompt opens the think block.
OPENS_THINKING = QWEN3_STYLE.replace(
    "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"
)


@pytest.fixture(scope="module")
def reasoning_model(make_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer has <think> and </think> tokens (its vocabulary covers
    them) and whose template opens the think block."""
    out = tmp_path_factory.mktemp("reasoning") / "model"
    shutil.copytree(make_model(vocab_size=1040), out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = OPENS_THINKING
    tokenizer.save_pretrained(str(out))
    return out


def finished(output: list[int], prompt: list[int], reason: str, text: str | None = None) -> Request:
    req = Request(row_index=0, prompt_ids=prompt, params=SamplingParams(max_tokens=99))
    req.output.token_ids, req.output.finish_reason, req.output.completion = output, reason, text
    return req


def test_the_split_by_token_ids(reasoning_model: Path, tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(reasoning_model))
    split = ReasoningSplit(tokenizer, "qwen3")
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    why = tokenizer.encode("why not", add_special_tokens=False)
    answer = tokenizer.encode("\n\nreturn 1", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode("hi", add_special_tokens=False)
    # Thought, then the answer (the stop token is not text).
    got = split.split(finished([start, *why, end, *answer, eos], prompt, "stop"))
    assert got == ("why not", "return 1", len(why))
    # Cut inside the block: no answer.
    assert split.split(finished([start, *why], prompt, "length")) == ("why not", None, len(why))
    # The template opened the block: the output has only its end.
    assert split.split(finished([*why, end, *answer], [*prompt, start], "length"))[:2] == (
        "why not",
        "return 1",
    )
    # No think block: the completion as decoded.
    assert split.split(finished(answer, prompt, "length", "return 1")) == (None, "return 1", 0)
    plain = AutoTokenizer.from_pretrained(str(tiny_model))
    with pytest.raises(JobError, match="needs <think> and </think>"):
        ReasoningSplit(plain, "qwen3")
    auto = ReasoningSplit(plain, "auto")  # splits nothing
    assert auto.split(finished(answer, prompt, "length", "x")) == (None, "x", 0)


def test_a_row_cut_while_thinking_has_no_answer(tmp_path: Path, reasoning_model: Path) -> None:
    write_chats(tmp_path / "in")
    job = str(write_job(tmp_path, reasoning_model, max_tokens=4))
    result = invoke("run", job, "--reasoning-parser", "qwen3")
    assert result.exit_code == 0, result.output
    table = read_output(tmp_path / "out")
    assert {"reasoning", "reasoning_tokens"} <= set(table.column_names)
    tokenizer = AutoTokenizer.from_pretrained(str(reasoning_model))
    end = tokenizer.convert_tokens_to_ids("</think>")
    for row in table.to_pylist():
        assert end not in row["completion_token_ids"]  # a tiny model does not stop thinking
        assert row["finish_reason"] == "length" and row["completion"] is None
        assert row["reasoning_tokens"] == row["completion_tokens"] == 4
        text = tokenizer.decode(row["completion_token_ids"], skip_special_tokens=True)
        assert row["reasoning"] == text.strip()
    # Without the split the columns are not there, and the completion is the whole text.
    plain = invoke("run", job, "--output", str(tmp_path / "plain"))
    assert plain.exit_code == 0, plain.output
    assert "reasoning" not in read_output(tmp_path / "plain").column_names


def test_qwen3_split_needs_the_think_tokens(tmp_path: Path, thinking_model: Path) -> None:
    write_chats(tmp_path / "in")
    job = str(write_job(tmp_path, thinking_model))
    for command in ("validate", "run"):
        result = invoke(command, job, "--reasoning-parser", "qwen3")
        assert_one_line_error(result, "needs <think> and </think> as single tokens")


# -- the thinking budget (issue 23, part 3) ---------------------------------------------------


def test_a_thinking_budget_forces_the_end_of_the_block(
    tmp_path: Path, reasoning_model: Path
) -> None:
    """The template opens the block; after 3 tokens in it the host appends the end as Qwen3
    writes it, and the row goes on from there: the tokens after equal a run whose prompt holds
    the forced ones, and a draft changes nothing."""
    tokenizer = AutoTokenizer.from_pretrained(str(reasoning_model))
    forced = tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
    write_chats(tmp_path / "in")
    job = str(write_job(tmp_path, reasoning_model, max_tokens=12))
    args = ["--max-thinking-tokens", "3", "--reasoning-parser", "qwen3"]
    assert invoke("run", job, *args).exit_code == 0
    rows = read_output(tmp_path / "out").to_pylist()
    for row in rows:
        ids = row["completion_token_ids"]
        assert ids[3 : 3 + len(forced)] == forced and len(ids) == 12
        inside = 3 + forced.index(tokenizer.convert_tokens_to_ids("</think>"))  # its newline
        assert row["reasoning_tokens"] == inside and row["completion"] is not None
    draft = make_tiny_draft(tmp_path / "draft", reasoning_model, block_size=4)
    out = str(tmp_path / "drafted")
    assert invoke("run", job, *args, "--draft", str(draft), "--output", out).exit_code == 0
    drafted = read_output(Path(out)).column("completion_token_ids").to_pylist()
    assert drafted == [r["completion_token_ids"] for r in rows]
    # The continuation is the target's own from the forced tokens.
    prompt = tokenizer.apply_chat_template(
        HELLO, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    head = rows[0]["completion_token_ids"][: 3 + len(forced)]
    pq.write_table(pa.table({"prompt_token_ids": [[*prompt, *head]]}), tmp_path / "ids.parquet")
    out = str(tmp_path / "resumed")
    result = invoke(
        "run",
        job,
        "--input",
        str(tmp_path / "ids.parquet"),
        "--output",
        out,
        "--max-tokens",
        str(12 - len(head)),
    )
    assert result.exit_code == 0, result.output
    rest = read_output(Path(out)).column("completion_token_ids").to_pylist()[0]
    assert rows[0]["completion_token_ids"] == head + rest


def test_a_thinking_budget_needs_think_tokens_and_no_logprobs(
    tmp_path: Path, thinking_model: Path, reasoning_model: Path
) -> None:
    write_chats(tmp_path / "in")
    plain = str(write_job(tmp_path, thinking_model))
    for command in ("validate", "run"):
        result = invoke(command, plain, "--max-thinking-tokens", "3")
        assert_one_line_error(result, "needs <think> and </think> tokens")
    job = str(write_job(tmp_path, reasoning_model))
    result = invoke("run", job, "--max-thinking-tokens", "3", "--logprobs", "0")
    assert_one_line_error(result, "do not go together")
