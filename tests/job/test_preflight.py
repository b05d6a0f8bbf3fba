"""Start-up checks without weights: `validate` and `run` refuse the same jobs with the same line,
and `run` refuses them before loading any weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

import batchrun.engine.engine
import batchrun.models.safetensors_reader
from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.config.preflight import preflight
from batchrun.errors import JobError
from batchrun.tools.tiny_draft import make_tiny_draft


def config_only_copy(model: Path, out: Path) -> Path:
    """The model directory without its weights: everything preflight may read."""
    return Path(shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors")))


def edit_json(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def write_input(directory: Path, column: str = "prompt") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if column == "messages":
        kind = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
        values = pa.array([[{"role": "user", "content": "hi"}]], kind)
    else:
        values = pa.array(["def f(x):"])
    pq.write_table(pa.table({column: values}), directory / "in.parquet")


def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading any tensor data (not a header) of a checkpoint fails the test."""

    def read(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("preflight read weights")

    monkeypatch.setattr(batchrun.models.safetensors_reader, "_pread_into", read)
    monkeypatch.setattr(batchrun.models.safetensors_reader, "_read_chunked", read)


def test_preflight_finds_what_run_uses_without_weights(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4, target_layer_ids=[0, 1])
    target = tiny_model
    no_weight_reads(monkeypatch)
    job = JobSpec.from_keys(dict(input="in", output="out", target=str(target), draft=str(draft)))
    found = preflight(job)
    config = json.loads((tiny_model / "config.json").read_text())
    assert (found.device, found.dtype, found.attention_backend) == (
        torch.device("cpu"),
        torch.float32,
        "torch",
    )
    assert found.target.vocab_size == config["vocab_size"]
    assert found.target.num_layers == config["num_hidden_layers"]
    assert found.block_size == 4 and found.draft is not None
    assert found.draft.target_layer_ids == (0, 1)
    assert found.tokenizer.chat_template
    plain = preflight(
        JobSpec.from_keys(dict(input="in", output="out", target=str(target), dtype="bfloat16"))
    )
    assert plain.draft is None and plain.block_size is None and plain.dtype == torch.bfloat16


def test_validate_prints_what_preflight_found(tmp_path: Path, tiny_model: Path) -> None:
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4, target_layer_ids=[1])
    write_input(tmp_path / "in")
    args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    args += ["--target", str(tiny_model), "--draft", str(draft)]
    result = CliRunner().invoke(cli, ["validate", *args])
    assert result.exit_code == 0, result.output
    assert "device: cpu, dtype: float32, attention backend: torch" in result.output
    assert "(z-lab format, 1 layers, block size 4, target layers [1]" in result.output
    assert result.output.endswith("ok\n")


def test_validate_describes_a_speculators_draft(tmp_path: Path, tiny_model: Path) -> None:
    draft = make_tiny_draft(
        tmp_path / "draft",
        tiny_model,
        num_layers=2,
        block_size=4,
        target_layer_ids=[0, 1],
        sliding_window=6,
        sliding_layers=[1],
        draft_vocab=list(range(0, 1024, 4)),
        speculators=True,
    )
    write_input(tmp_path / "in")
    args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    args += ["--target", str(tiny_model), "--draft", str(draft)]
    result = CliRunner().invoke(cli, ["validate", *args])
    assert result.exit_code == 0, result.output
    assert (
        "(speculators format, 2 layers (1 sliding over 6 positions), block size 4, "
        "target layers [0, 1], mask id 1023, draft vocabulary 256)"
    ) in result.output


# A bad job: (how to break it, the message both commands must give).
Breaker = Callable[[Path, Path, pytest.MonkeyPatch], list[str]]


def draft_flags(**kw: Any) -> Breaker:
    def make(tmp_path: Path, target: Path, _: pytest.MonkeyPatch) -> list[str]:
        keys = {"block_size": 4, **kw}
        extra = keys.pop("extra_tensors", None)
        draft = make_tiny_draft(tmp_path / "draft", target, **keys)
        if extra:
            weights = load_file(str(draft / "model.safetensors")) | extra
            make_tiny_draft(draft, target, **keys, state_dict=weights)
        return ["--draft", str(draft)]

    return make


def target_flags(change: Callable[[Path], Any]) -> Breaker:
    def make(tmp_path: Path, target: Path, _: pytest.MonkeyPatch) -> list[str]:
        copy = config_only_copy(target, tmp_path / "broken-target")
        change(copy)
        return ["--target", str(copy)]

    return make


def no_cuda(tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return ["--device", "cuda"]


def flags(*values: str) -> Breaker:
    return lambda tmp_path, target, monkeypatch: list(values)


def chat_without_template(tmp_path: Path, target: Path, _: pytest.MonkeyPatch) -> list[str]:
    write_input(tmp_path / "chat", "messages")
    copy = config_only_copy(target, tmp_path / "no-template")
    (copy / "chat_template.jinja").unlink()
    return ["--input", str(tmp_path / "chat"), "--target", str(copy)]


BAD_JOBS: dict[str, tuple[Breaker, str]] = {
    "temperature-nan": (flags("--temperature", "nan"), "temperature must be a finite number"),
    "temperature-inf": (flags("--temperature", "inf"), "temperature must be a finite number"),
    "prompt-logprobs-k": (
        flags("--prompt-logprobs", "21"),
        "job key 'prompt_logprobs': 21 is greater than the maximum of 20",
    ),
    "no-cuda": (no_cuda, "no CUDA device"),
    "attention-backend": (
        flags("--attention-backend", "flashinfer"),
        "'flashinfer' needs a CUDA GPU and the flashinfer-python package",
    ),
    "draft-hidden-size": (draft_flags(extra_config={"hidden_size": 48}), "hidden_size 48"),
    "draft-vocab": (draft_flags(extra_config={"vocab_size": 7}), "vocab_size 7"),
    "draft-layer-ids": (draft_flags(target_layer_ids=[0, 99]), "target_layer_ids"),
    "draft-mask-id": (draft_flags(mask_token_id=10**6), "mask_token_id 1000000"),
    "draft-block-size": (draft_flags(extra_config={"block_size": 1}), "block_size must be"),
    "draft-variant": (
        draft_flags(extra_config={"architectures": ["Eagle3DraftModel"]}),
        "Eagle3DraftModel",
    ),
    "draft-d2t": (
        draft_flags(
            draft_vocab=list(range(100)), extra_tensors={"d2t": torch.zeros(8, dtype=torch.int64)}
        ),
        "d2t has shape [8], expected [100]",
    ),
    "draft-window": (draft_flags(sliding_window=2), "sliding_window 2 smaller than the block"),
    "draft-speculators": (
        draft_flags(speculators=True, extra_config={"speculators_model_type": "eagle3"}),
        "speculators_model_type 'eagle3' is not supported",
    ),
    "batch-below-block": (
        lambda tmp_path, target, mp: [
            *draft_flags()(tmp_path, target, mp),
            "--max-batched-tokens",
            "3",
        ],
        "max_batched_tokens 3",
    ),
    "target-config": (
        target_flags(lambda d: (d / "config.json").write_text("{not json")),
        "cannot read",
    ),
    "target-model-type": (
        target_flags(lambda d: edit_json(d / "config.json", lambda c: c.update(model_type="t5"))),
        "model_type is 't5'",
    ),
    "target-tokenizer": (
        target_flags(lambda d: (d / "tokenizer.json").write_text("{not json")),
        "cannot load the tokenizer",
    ),
    "chat-without-template": (chat_without_template, "has no chat template"),
}


def one_line_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_validate_and_run_refuse_alike_before_loading_weights(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    breaker, message = BAD_JOBS[case]
    write_input(tmp_path / "in")
    base = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    bad = [*base, "--target", str(tiny_model), *breaker(tmp_path, tiny_model, monkeypatch)]
    assert_refused_alike(bad, message, tmp_path / "out", monkeypatch)


def assert_refused_alike(
    flags: list[str], message: str, out: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """validate refuses the flags in one line holding `message`; run refuses them in the same
    line, before loading any weights and writing anything to `out`. Returns the line."""

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("run loaded weights for a job validate refuses")

    monkeypatch.setattr(batchrun.engine.engine, "Engine", no_engine)
    refused = one_line_error(CliRunner().invoke(cli, ["validate", *flags]))
    assert message in refused
    assert one_line_error(CliRunner().invoke(cli, ["run", *flags])) == refused
    assert not out.exists()
    return refused


def test_an_output_that_is_the_input_directory_is_refused_by_name(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_input(tmp_path / "in")
    flags = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "in")]
    flags += ["--target", str(tiny_model)]
    message = f"input directory {str(tmp_path / 'in')!r} is the output directory"
    assert_refused_alike(flags, message, tmp_path / "in" / "_progress", monkeypatch)


def test_check_batch_budget() -> None:
    from batchrun.engine.config import check_batch_budget

    check_batch_budget(16, 16)
    check_batch_budget(1, 1)
    with pytest.raises(JobError, match="max_batched_tokens 15 .* 16"):
        check_batch_budget(15, 16)
