"""Chat template arguments that name what batchrun's apply_chat_template call takes itself
(issue 32, item 6): the job's are refused by `validate` and `run` in one line, before any row;
a row's are that row's error, in the same words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.io.input.chat_args import taken_names
from tests.job.test_chat_template_args import write_chats
from tests.job.test_cli import assert_one_line_error, invoke, read_output, write_job

pytestmark = pytest.mark.usefixtures("one_thread")

# Names apply_chat_template would fail every row on, or take as its own switch.
PASSED_BY_BATCHRUN = ["messages", "conversations", "sanitize_control_tokens", "tokenize"]


@pytest.mark.parametrize("name", PASSED_BY_BATCHRUN)
def test_the_job_may_not_name_them(tmp_path: Path, tiny_model: Path, name: str) -> None:
    write_chats(tmp_path / "in")
    job = str(write_job(tmp_path, tiny_model))
    flags = ["--chat-template-kwargs", json.dumps({name: 1})]
    message = f"job key 'chat_template_kwargs': {name!r} is set by batchrun"
    for command in ("validate", "run"):
        assert_one_line_error(invoke(command, job, *flags), message)
    assert not (tmp_path / "out").exists()


def test_every_name_the_call_takes_is_refused() -> None:
    assert set(PASSED_BY_BATCHRUN) | {"add_generation_prompt", "return_dict"} <= taken_names()
    for name in sorted(taken_names()):
        with pytest.raises(JobError, match=f"{name!r} is set by batchrun"):
            JobSpec.from_keys(
                dict(input="in", output="out", target="t", chat_template_kwargs={name: 1})
            )


def test_a_rows_cell_naming_them_is_its_error(tmp_path: Path, tiny_model: Path) -> None:
    cells = [json.dumps({name: 1}) for name in PASSED_BY_BATCHRUN] + [None]
    write_chats(tmp_path / "in", cells)
    assert invoke("run", str(write_job(tmp_path, tiny_model, max_tokens=2))).exit_code == 0
    rows = read_output(tmp_path / "out").to_pylist()
    for name, row in zip(PASSED_BY_BATCHRUN, rows, strict=False):
        assert row["error"] == (
            f"chat_template_kwargs: {name!r} is set by batchrun, not by the template's arguments"
        )
    assert rows[-1]["error"] is None
