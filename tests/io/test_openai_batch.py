"""OpenAI Batch files in and out: a JSONL of chat and completion requests runs as a whole job on
the tiny model and `batchrun export` writes one OpenAI Batch result line per request; bad lines
become error rows named in the export; the body's sampling fields become per-row settings."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from batchrun.cli import cli
from batchrun.io.input import openai_batch
from batchrun.io.input.openai_batch import (
    REQUEST_ERROR_COLUMN,
    SAMPLING_KINDS,
    BadRequest,
    body_columns,
    request_row,
)
from batchrun.runners.ray import run as ray_run
from batchrun.sampling.option import Kind
from tests.job.test_cli import kill_when
from tests.job.test_preflight import assert_refused_alike

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def request(custom_id: str, url: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat(custom_id: str, text: str, **body: Any) -> str:
    return request(
        custom_id, CHAT, model="tiny-chat", messages=[{"role": "user", "content": text}], **body
    )


def completion(custom_id: str, text: str, **body: Any) -> str:
    return request(custom_id, COMPLETIONS, prompt=text, **body)


def run_job(tmp_path: Path, model: Path, lines: list[str], *flags: str) -> Path:
    tmp_path.mkdir(exist_ok=True)
    requests = tmp_path / "requests.jsonl"
    if not requests.exists():  # the same file for every run (its mtime is in the fingerprint)
        requests.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = invoke(
        "run", "--input", str(requests), "--output", str(out), "--target", str(model),
        "--max-tokens", "6", "--quiet", *flags,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def export(out: Path, tmp_path: Path) -> list[dict[str, Any]]:
    results = tmp_path / "results.jsonl"
    result = invoke("export", str(out), "--format", "openai-batch", "--output", str(results))
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in results.read_text().splitlines()]


def by_id(results: list[dict[str, Any]]) -> dict[str | None, dict[str, Any]]:
    """The results by custom_id (None: a line without one, which is not JSON, say)."""
    ids = [line["custom_id"] for line in results if line["custom_id"] is not None]
    assert len(set(ids)) == len(ids), "one result per custom_id"
    return {line["custom_id"]: line for line in results}


def timeless(results: list[dict[str, Any]]) -> list[str]:
    """The results without `created` (when a part was written), in custom_id order."""
    for line in results:
        if line["response"] is not None:
            line["response"]["body"].pop("created")
    return sorted(json.dumps(line, sort_keys=True) for line in results)


BAD_LINES = {
    "not json": "{not json",
    "array": "[1, 2]",
    "no body": json.dumps({"custom_id": "no-body", "method": "POST", "url": CHAT}),
    "unsupported": completion("unsupported", "x", tools=[], suffix="y"),
    "bad url": request("bad-url", "/v1/embeddings", input="x"),
    "bad method": json.dumps({"custom_id": "bad-method", "method": "GET", "url": CHAT, "body": {}}),
    "logprobs": chat("logprobs", "hi", logprobs=True),
    "bad type": completion("bad-type", "x", temperature="hot"),
    "bad range": completion("bad-range", "x", top_p=2.0),
}


def test_a_batch_file_round_trips_one_result_per_custom_id(
    tmp_path: Path, tiny_model: Path
) -> None:
    lines = [
        chat("chat-0", "Write a function.", max_completion_tokens=3, ignore_eos=True),
        completion("cmpl-0", "def main(", max_tokens=4, n=2, ignore_eos=True, temperature=0.8),
        chat("chat-1", "Hello", stop="\n", seed=5),
        "",  # a blank line is no request
        completion("cmpl-1", "import os\n", max_tokens=2, ignore_eos=True),
        *BAD_LINES.values(),
    ]
    out = run_job(tmp_path, tiny_model, lines)
    results = export(out, tmp_path)
    assert len(results) == len(lines) - 1  # every non-blank line once
    found = by_id(results)
    assert set(found) >= {"chat-0", "chat-1", "cmpl-0", "cmpl-1"}

    chat_body = found["chat-0"]["response"]["body"]
    assert found["chat-0"]["error"] is None and found["chat-0"]["response"]["status_code"] == 200
    assert chat_body["object"] == "chat.completion" and chat_body["model"] == "tiny-chat"
    (choice,) = chat_body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] == "length"
    # max_completion_tokens (with ignore_eos) held the completion to exactly 3 tokens
    assert chat_body["usage"]["completion_tokens"] == 3
    usage = chat_body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 3

    text_body = found["cmpl-0"]["response"]["body"]
    assert text_body["object"] == "text_completion"
    assert [c["index"] for c in text_body["choices"]] == [0, 1]  # n = 2
    assert all(isinstance(c["text"], str) for c in text_body["choices"])
    assert text_body["usage"]["completion_tokens"] == 2 * 4  # max_tokens 4 for each sample
    assert found["cmpl-1"]["response"]["body"]["usage"]["completion_tokens"] == 2

    # The parts keep custom_id and url beside row_index, and the run's settings per row.
    table = pq.read_table(sorted(out.glob("part-*.parquet"))).sort_by("row_index")
    rows = {row["custom_id"]: row for row in table.to_pylist() if row["custom_id"]}
    assert rows["chat-1"]["url"] == CHAT and rows["chat-1"]["stop"] == ["\n"]
    assert rows["chat-1"]["seed"] == 5 and rows["chat-0"]["max_tokens"] == 3
    assert "\n" not in rows["chat-1"]["completion"]  # the stop string cut it

    errors = [line for line in results if line["error"] is not None]
    assert len(errors) == len(BAD_LINES)
    assert all(line["response"] is None for line in errors)
    assert all(line["error"]["code"] == "invalid_request" for line in errors)
    messages = [line["error"]["message"] for line in errors]
    for expected in (
        "line 6: not JSON",
        "line 7: not a request",
        "not a request: it has no body",
        "unsupported fields of the body: 'suffix', 'tools'",
        "url '/v1/embeddings' is not supported",
        "method must be POST",
        "logprobs is not supported per request",
        "temperature must be a number, got 'hot'",
        "top_p must be in (0, 1], got 2.0",
    ):
        assert sum(expected in message for message in messages) == 1, (expected, messages)
    assert found["unsupported"]["error"]["message"].startswith("line 9: ")

    parts = sorted(out.glob("part-*.parquet"))
    run_job(tmp_path, tiny_model, lines)
    assert sorted(out.glob("part-*.parquet")) == parts  # a second run adds nothing
    assert export(out, tmp_path) == results


def test_shards_read_their_own_groups_of_lines(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_batch, "GROUP_ROWS", 3)  # several row groups in a short file
    lines = [completion(f"r{i}", f"x = {i}", max_tokens=2) for i in range(8)]
    lines.insert(4, "not json")
    for shard in ("0/2", "1/2"):
        run_job(tmp_path, tiny_model, lines, "--shard", shard)
    shards = {part.name[:19] for part in (tmp_path / "out").glob("part-*.parquet")}
    assert shards == {"part-00000-of-00002", "part-00001-of-00002"}  # both had rows
    found = by_id(export(tmp_path / "out", tmp_path))
    assert set(found) == {f"r{i}" for i in range(8)} | {None}
    assert found[None]["error"]["message"].startswith("line 5: not JSON")


@pytest.mark.slow
def test_kill_9_and_resume_export_every_request_once(tmp_path: Path, tiny_model: Path) -> None:
    lines = [completion(f"r{i}", f"class Model{i}:\n    def forward(self, x):") for i in range(10)]
    lines[3] = "not json"
    reference = run_job(tmp_path / "reference", tiny_model, lines, "--rows-per-part", "2")
    expected = export(reference, tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "{tmp_path / "reference" / "requests.jsonl"}"\noutput = "{tmp_path / "out"}"\n'
        f'target = "{tiny_model}"\nmax_tokens = 6\nrows_per_part = 2\nmax_batch_size = 2\n'
        "quiet = true\n"
    )
    killed = kill_when(job, lambda: len(list((tmp_path / "out").glob("part-*.parquet"))) >= 1)
    assert killed, "the run finished before it could be killed"
    committed = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).num_rows
    assert 0 < committed < len(lines)  # the kill left work to resume
    assert invoke("run", str(job)).exit_code == 0
    resumed = export(tmp_path / "out", tmp_path)
    assert timeless(resumed) == timeless(expected)  # every request once, as before


def test_export_of_a_parquet_job_and_one_line_errors(tmp_path: Path, tiny_model: Path) -> None:
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["def f(", "import "]}), prompts)
    out = tmp_path / "out"
    ran = invoke("run", "--input", str(prompts), "--output", str(out), "--target", str(tiny_model),
                 "--max-tokens", "3", "--quiet")  # fmt: skip
    assert ran.exit_code == 0, ran.output
    results = export(out, tmp_path)
    assert sorted(line["custom_id"] for line in results) == ["row-0", "row-1"]
    assert all(line["response"]["body"]["object"] == "text_completion" for line in results)

    numbered = tmp_path / "numbered.parquet"
    pq.write_table(pa.table({"prompt": ["def f(", "import "], "custom_id": [7, None]}), numbered)
    ran = invoke("run", "--input", str(numbered), "--output", str(tmp_path / "out_n"),
                 "--target", str(tiny_model), "--max-tokens", "3", "--quiet")  # fmt: skip
    assert ran.exit_code == 0, ran.output
    ids = [line["custom_id"] for line in export(tmp_path / "out_n", tmp_path)]
    assert sorted(ids, key=str) == ["7", None]  # a string, as the format's; null stays null

    missing = invoke("export", str(tmp_path / "nothing"), "--output", str(tmp_path / "r.jsonl"))
    assert missing.exit_code == 2 and "no part files" in missing.stderr
    assert len(missing.stderr.splitlines()) == 1

    requests = tmp_path / "requests.jsonl"
    requests.write_text(chat("a", "hi") + "\n")
    flagged = invoke("validate", "--input", str(requests), "--output", str(tmp_path / "o2"),
                     "--target", str(tiny_model), "--prompt-column", "prompt")  # fmt: skip
    assert flagged.exit_code == 2 and "does not apply to OpenAI Batch requests" in flagged.stderr


def test_a_custom_id_twice_is_refused_by_validate_and_run_alike(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    one = tmp_path / "one.jsonl"
    one.write_text("\n".join([chat("dup", "hi"), "{not json", "", chat("dup", "again")]) + "\n")
    flags = ["--input", str(one), "--output", str(out), "--target", str(tiny_model)]
    line = assert_refused_alike(flags, "custom_id 'dup' is on lines 1 and 4 of", out, monkeypatch)
    assert str(one) in line

    inputs = tmp_path / "two"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text(chat("a", "hi") + "\n" + completion("same", "x") + "\n")
    (inputs / "b.jsonl").write_text(chat("same", "hi") + "\n")
    flags = ["--input", str(inputs / "*.jsonl"), "--output", str(out), "--target", str(tiny_model)]
    line = assert_refused_alike(flags, "custom_id 'same' is on line 2 of", out, monkeypatch)
    a, b = str(inputs / "a.jsonl"), str(inputs / "b.jsonl")
    assert f"line 2 of {a!r} and line 1 of {b!r}" in line


def test_ray_refuses_a_batch_file_in_one_line_before_it_starts(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_ray() -> None:
        raise AssertionError("Ray was imported for a job --ray refuses")

    monkeypatch.setattr(ray_run, "import_ray", no_ray)
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "requests.jsonl").write_text(chat("a", "hi") + "\n")
    for spec in (inputs / "requests.jsonl", inputs / "*"):
        out = tmp_path / "out"
        refused = invoke("run", "--input", str(spec), "--output", str(out),
                         "--target", str(tiny_model), "--ray")  # fmt: skip
        assert refused.exit_code == 2 and len(refused.stderr.splitlines()) == 1, refused.output
        assert (
            "--ray reads Parquet inputs only" in refused.stderr
            and "requests.jsonl" in refused.stderr
        )
        assert not out.exists()


# -- the body's fields -------------------------------------------------------------------------


def test_openai_names_map_to_the_per_row_settings() -> None:
    columns = body_columns(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7,
            "stop": "END",
            "seed": 3,
            "n": 2,
            "best_of": 2,
            "logit_bias": {"12": -100},
            "logprobs": False,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "object"}},
            },
            "stream": False,
            "user": "someone",
            "temperature": None,  # null: the job's
        },
        chat=True,
    )
    assert columns == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "stop": ["END"],
        "seed": 3,
        "n": 2,
        "logit_bias": '{"12": -100}',
        "json_schema": '{"type": "object"}',
    }
    with pytest.raises(BadRequest, match="max_completion_tokens and max_tokens are both set"):
        body_columns({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "max_completion_tokens": 2}, chat=True)  # fmt: skip
    top_seed = body_columns({"prompt": "x", "seed": 2**64 - 1}, chat=False)["seed"]
    assert top_seed == 2**64 - 1  # every seed batchrun takes, beyond int64
    with pytest.raises(BadRequest, match="unsupported field of the body: 'messages'"):
        body_columns({"prompt": "x", "messages": []}, chat=False)


def test_every_declared_per_row_setting_is_a_body_field() -> None:
    """The mapping is derived from the sampling declarations: each per-row column is taken under
    its own name, with a value of its kind, into a column of that name."""
    samples = {
        Kind.INT: 1,
        Kind.FLOAT: 0.5,
        Kind.BOOL: True,
        Kind.STRINGS: ["a"],
        Kind.TOKEN_IDS: [1, 2],
        Kind.TOKEN_BIAS: {"3": 1.0},
    }
    for name, kind in SAMPLING_KINDS.items():
        columns = body_columns({"prompt": "x", name: samples[kind]}, chat=False)
        assert name in columns, name
        row = request_row(completion("a", "x", **{name: samples[kind]}).encode(), 1)
        assert row.get(REQUEST_ERROR_COLUMN) is None and name in row, name


def test_no_line_can_do_more_than_make_its_own_error_row() -> None:
    """Random edits of good lines (values of every type, bytes that break the JSON or its
    UTF-8) each give one row that Arrow takes: a request's, or request_error saying why not."""
    rng = random.Random(35)
    good = [chat("a", "hi", max_tokens=3, stop=["x"], n=2), completion("b", "x", seed=1)]
    values = [None, True, -1, 1.5, 2**70, "s", "\ud800", [], {}, [1], ["a"], {"1": 1}]
    for number in range(2000):
        line = json.loads(rng.choice(good))
        place = rng.choice([line, line["body"], line["body"].get("messages", [{}])[0]])
        place[rng.choice([*place, "extra", "n", "top_k", "stream"])] = rng.choice(values)
        data = bytearray(json.dumps(line).encode())
        if rng.random() < 0.2:
            data[rng.randrange(len(data))] = rng.randrange(256)
        row = request_row(bytes(data), number)
        batch = pa.RecordBatch.from_pylist([row], schema=openai_batch.REQUEST_SCHEMA)
        error = batch.column(REQUEST_ERROR_COLUMN)[0].as_py()
        assert error is None or error.startswith(f"line {number}: "), error
