"""`validate` says ok exactly when `run` starts: each start-up refusal is one line and exit 2 in
both, the same line, before any weights load; and what `validate` accepts, `run` runs.

The cases come from a hostile probe: a target with pytorch_model.bin but no safetensors, a draft
without safetensors, checkpoints whose tensors do not fit the config, an unreadable
generation_config.json, a verify width past the block, batch limits past any memory, an output
name longer than the filesystem allows, and seeds at and past the ends of [-2^63, 2^64).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import batchrun.engine.memory
from batchrun.bench.shapes import shape_from_flags
from batchrun.cli import cli
from batchrun.config.options import job_options
from batchrun.engine.memory import BatchFootprint, check_batch_memory
from batchrun.engine.options import MAX_BATCH_SIZE, MAX_BATCHED_TOKENS
from batchrun.errors import JobError
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.job.test_preflight import assert_refused_alike, one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")

# How to break a job: extra flags, made in tmp_path from the tiny target.
Breaker = Callable[[Path, Path, pytest.MonkeyPatch], list[str]]


def write_input(directory: Path, table: pa.Table | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        table or pa.table({"prompt": ["def f(x):", "import os"]}), directory / "in.parquet"
    )
    return directory


def model_copy(model: Path, out: Path, change: Callable[[Path], Any]) -> Path:
    copy = Path(shutil.copytree(model, out))
    change(copy)
    return copy


def bin_only(directory: Path) -> None:
    """The weights as pytorch_model.bin, as transformers saves without safetensors."""
    weights = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    torch.save(weights, directory / "pytorch_model.bin")


def edit_weights(change: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        weights = load_file(str(directory / "model.safetensors"))
        change(weights)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})

    return edit


def target(change: Callable[[Path], Any]) -> Breaker:
    def make(tmp_path: Path, model: Path, _: pytest.MonkeyPatch) -> list[str]:
        return ["--target", str(model_copy(model, tmp_path / "broken", change))]

    return make


def draft(change: Callable[[Path], Any] | None = None, *extra: str) -> Breaker:
    def make(tmp_path: Path, model: Path, _: pytest.MonkeyPatch) -> list[str]:
        made = make_tiny_draft(tmp_path / "draft", model, block_size=4, target_layer_ids=[0, 1])
        if change is not None:
            change(made)
        return ["--draft", str(made), *extra]

    return make


def flags(*values: str) -> Breaker:
    return lambda tmp_path, model, monkeypatch: list(values)


def memory_of(available: int, *values: str) -> Breaker:
    def make(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        monkeypatch.setattr(batchrun.engine.memory, "device_memory_bytes", lambda _: available)
        return list(values)

    return make


def small_kv_budget(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A CPU KV budget of one page, which a block of 8 (and the 2 steps in flight) overfills."""
    monkeypatch.setattr(batchrun.engine.memory, "CPU_KV_BUDGET_BYTES", 1)
    made = make_tiny_draft(tmp_path / "draft", model, block_size=8, target_layer_ids=[0, 1])
    return ["--draft", str(made)]


def unlink_safetensors(directory: Path) -> None:
    for file in directory.glob("*.safetensors"):
        file.unlink()


LONG_NAME = "o" * 300  # NAME_MAX is 255 bytes on every common filesystem

BAD_JOBS: dict[str, tuple[Breaker, str]] = {
    "target-pytorch-bin-only": (target(bin_only), "no .safetensors files in"),
    "draft-without-safetensors": (draft(unlink_safetensors), "no .safetensors files in"),
    "target-tensor-shape": (
        target(edit_weights(lambda w: w.update({"model.norm.weight": torch.ones(3)}))),
        "target: tensor 'model.norm.weight' has shape [3], expected [64]",
    ),
    "target-missing-tensor": (
        target(edit_weights(lambda w: w.pop("model.norm.weight"))),
        "target: checkpoint lacks 'model.norm.weight'",
    ),
    "target-unexpected-tensor": (
        target(edit_weights(lambda w: w.update({"model.extra": torch.ones(2)}))),
        "target: unexpected tensor 'model.extra'",
    ),
    "target-bad-header": (
        target(lambda d: (d / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{x")),
        "header length 16 runs past the end of the file",
    ),
    "draft-tensor-shape": (
        draft(edit_weights(lambda w: w.update({"fc.weight": torch.ones(2, 2)}))),
        "draft: tensor 'fc.weight' has shape [2, 2]",
    ),
    "generation-config": (
        target(lambda d: (d / "generation_config.json").write_text("{not json")),
        "cannot read the target's eos_token_id",
    ),
    "verify-width": (
        draft(None, "--verify-width", "5"),
        "verify width must be auto, full or 1 .. 4",
    ),
    "batch-size-schema": (
        flags("--max-batch-size", str(MAX_BATCH_SIZE + 1)),
        f"job key 'max_batch_size': {MAX_BATCH_SIZE + 1} is greater than the maximum",
    ),
    "batched-tokens-schema": (
        flags("--max-batched-tokens", str(10**9)),
        f"job key 'max_batched_tokens': {10**9} is greater than the maximum of "
        f"{MAX_BATCHED_TOKENS}",
    ),
    "batch-size-memory": (
        memory_of(64 << 20, "--max-batch-size", str(MAX_BATCH_SIZE)),
        f"max_batch_size {MAX_BATCH_SIZE} does not fit in the memory of cpu (64.0 MiB)",
    ),
    "batched-tokens-memory": (
        memory_of(64 << 20, "--max-batched-tokens", str(MAX_BATCHED_TOKENS)),
        f"max_batched_tokens {MAX_BATCHED_TOKENS} does not fit in the memory of cpu (64.0 MiB)",
    ),
    "kv-pool": (small_kv_budget, "the KV pool (1 pages of 16) is too small"),
    "weights-memory": (memory_of(1 << 16, "--max-batch-size", "1"), "the models do not fit"),
    "output-name-too-long": (
        lambda tmp_path, model, mp: ["--output", str(tmp_path / LONG_NAME)],
        "File name too long",
    ),
    "output-name-too-long-below-a-new-directory": (
        lambda tmp_path, model, mp: ["--output", str(tmp_path / "new" / LONG_NAME / "out")],
        "a name of 300 bytes is longer than the 255 its filesystem allows",
    ),
    "seed-below": (flags("--seed", str(-(2**63) - 1)), "job key 'seed'"),
    "seed-above": (flags("--seed", str(2**64)), "job key 'seed'"),
}


def base_flags(tmp_path: Path, model: Path) -> list[str]:
    write_input(tmp_path / "in")
    return [
        "--input",
        str(tmp_path / "in"),
        "--output",
        str(tmp_path / "out"),
        "--quiet",
        "--target",
        str(model),
    ]


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_validate_and_run_refuse_alike_before_loading_weights(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    breaker, message = BAD_JOBS[case]
    bad = [*base_flags(tmp_path, tiny_model), *breaker(tmp_path, tiny_model, monkeypatch)]
    assert_refused_alike(bad, message, tmp_path / "out", monkeypatch)


def test_the_memory_refusal_names_the_largest_value_that_fits(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = base_flags(tmp_path, tiny_model)
    monkeypatch.setattr(batchrun.engine.memory, "device_memory_bytes", lambda _: 64 << 20)
    refused = one_line_error(
        CliRunner().invoke(cli, ["validate", *args, "--max-batch-size", "60000"])
    )
    largest = refused.split("; max_batch_size ")[1].split(" fits at most")[0]
    assert refused.endswith("fits at most, with max_batched_tokens 4096")
    ok = CliRunner().invoke(cli, ["validate", *args, "--max-batch-size", largest])
    assert ok.exit_code == 0, ok.output
    over = CliRunner().invoke(cli, ["validate", *args, "--max-batch-size", str(int(largest) + 1)])
    assert one_line_error(over).startswith(f"batchrun: error: max_batch_size {int(largest) + 1}")


QWEN3_8B = shape_from_flags("qwen3-8b")  # the benchmark's shape table
H200 = 139 << 30


def test_the_memory_bound_keeps_real_jobs_and_refuses_absurd_ones() -> None:
    """Qwen3-8B in bfloat16 on an H200 with a 16-block draft: the docs' and the benchmarks'
    batches fit; a full batch of 65,536 requests cannot (a K/V page each is 150 GB alone)."""
    footprint = BatchFootprint(
        QWEN3_8B,
        QWEN3_8B,
        weight_bytes=8_200_000_000 * 2,
        element=2,
        width=16,
        draft_paged_layers=1,
    )
    cuda = torch.device("cuda", 0)
    for batch, tokens in [(64, 2048), (256, 16384), (512, 16384), (1024, 65536)]:
        check_batch_memory(footprint, batch, tokens, cuda, available=H200)
    with pytest.raises(JobError, match="max_batch_size 65536 does not fit .* fits at most"):
        check_batch_memory(footprint, 65536, 2048, cuda, available=H200)
    with pytest.raises(JobError, match="max_batched_tokens 16777216 does not fit"):
        check_batch_memory(footprint, 64, MAX_BATCHED_TOKENS, cuda, available=H200)
    with pytest.raises(JobError, match="the models do not fit in the memory of cuda:0"):
        check_batch_memory(footprint, 1, 16, cuda, available=8 << 30)


def test_the_memory_bound_grows_with_each_limit() -> None:
    footprint = BatchFootprint(QWEN3_8B, None, weight_bytes=0, element=2)
    base = footprint.bytes(1, 1)
    assert footprint.bytes(2, 1) > base and footprint.bytes(1, 2) > base
    # The residual stream and the MLP's gate/up rows of one token, at least.
    assert footprint.bytes(1, 2) - base >= (4096 + 2 * 12288) * 2
    # A request's K/V page (36 layers of 16 positions of 8 heads of 128, K and V) and logits.
    assert footprint.bytes(2, 2) - footprint.bytes(1, 2) >= 36 * 2 * 16 * 8 * 128 * 2 + 151936 * 4


# -- seeds: any integer in [-2^63, 2^64), as a flag, a job key and a column ---------------------

SEEDS_OK = [-1, -(2**63), 2**64 - 1]
SEEDS_BAD = [-(2**63) - 1, 2**64]


@pytest.mark.parametrize("seed", SEEDS_OK)
def test_a_seed_flag_in_range_is_accepted(tmp_path: Path, tiny_model: Path, seed: int) -> None:
    result = CliRunner().invoke(
        cli, ["validate", *base_flags(tmp_path, tiny_model), "--seed", str(seed)]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("seed", SEEDS_BAD)
def test_a_seed_flag_out_of_range_is_one_line(tmp_path: Path, tiny_model: Path, seed: int) -> None:
    args = [*base_flags(tmp_path, tiny_model), f"--seed={seed}"]
    for command in ("validate", "run"):
        assert "job key 'seed'" in one_line_error(CliRunner().invoke(cli, [command, *args]))


def write_job(tmp_path: Path, model: Path, seed: int) -> Path:
    write_input(tmp_path / "in")
    job = tmp_path / "job.toml"
    job.write_text(f'input = "in"\noutput = "out"\ntarget = "{model}"\nseed = {seed}\n')
    return job


@pytest.mark.parametrize("seed", SEEDS_OK)
def test_a_seed_job_key_in_range_is_accepted(tmp_path: Path, tiny_model: Path, seed: int) -> None:
    result = CliRunner().invoke(cli, ["validate", str(write_job(tmp_path, tiny_model, seed))])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("seed", SEEDS_BAD)
def test_a_seed_job_key_out_of_range_is_one_line(
    tmp_path: Path, tiny_model: Path, seed: int
) -> None:
    job = str(write_job(tmp_path, tiny_model, seed))
    for command in ("validate", "run"):
        refused = one_line_error(CliRunner().invoke(cli, [command, job]))
        assert f"job key 'seed': {seed} is " in refused


def test_job_seeds_minus_one_and_2_64_minus_1_sample_alike(
    tmp_path: Path, tiny_model: Path
) -> None:
    completions = []
    for seed in (-1, 2**64 - 1):
        out = tmp_path / str(seed)
        args = [*base_flags(out, tiny_model), "--output", str(out / "out"), "--seed", str(seed)]
        result = CliRunner().invoke(cli, ["run", *args, "--temperature", "1", "--max-tokens", "8"])
        assert result.exit_code == 0, result.output
        table = pq.read_table(sorted((out / "out").glob("part-*.parquet"))[0])
        completions.append(table.column("completion").to_pylist())
    assert completions[0] == completions[1]


def test_seed_columns_take_every_seed_in_range_and_refuse_the_rest_per_row(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A decimal128(20, 0) column holds every seed and the first ones past each end; int64 and
    uint64 columns hold -1 and 2^64 - 1, which sample alike."""
    seeds = [*SEEDS_OK, *SEEDS_BAD, -1, 2**64 - 1]
    table = pa.table(
        {
            "prompt": ["def f(x):"] * len(seeds),
            "seed": pa.array(seeds, pa.decimal128(20, 0)),
        }
    )
    args = [*base_flags(tmp_path, tiny_model), "--temperature", "1", "--max-tokens", "8"]
    write_input(tmp_path / "in", table)
    result = CliRunner().invoke(cli, ["run", *args])
    assert result.exit_code == 0, result.output
    out = pa.concat_tables(pq.read_table(p) for p in (tmp_path / "out").glob("part-*.parquet"))
    out = out.sort_by("row_index")
    errors = out.column("error").to_pylist()
    assert errors[:3] == [None] * 3 and errors[5:] == [None, None]
    for error in errors[3:5]:
        assert error.startswith("seed must be an integer in [-2^63, 2^64)")
    completion = out.column("completion").to_pylist()
    assert completion[0] == completion[2] == completion[5] == completion[6]  # -1 is 2^64 - 1
    for kind, seed in ((pa.int64(), -1), (pa.uint64(), 2**64 - 1)):
        shutil.rmtree(tmp_path / "out")
        write_input(
            tmp_path / "in", pa.table({"prompt": ["def f(x):"], "seed": pa.array([seed], kind)})
        )
        result = CliRunner().invoke(cli, ["run", *args])
        assert result.exit_code == 0, result.output
        part = sorted((tmp_path / "out").glob("part-*.parquet"))[0]
        assert pq.read_table(part).column("completion").to_pylist() == [completion[0]]


# -- every declared option with a bad value: validate refuses it as run does ---------------------


class Toml(str):
    """A job file value written as it stands (an inline table)."""


def toml_value(value: object) -> str:
    return value if isinstance(value, Toml) else json.dumps(value)


def listening_port(stack: contextlib.ExitStack) -> int:
    """A port a socket listens on while the test runs."""
    taken = stack.enter_context(socket.socket())
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return int(taken.getsockname()[1])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# Job keys of one bad value each (a function of the test's directory and an exit stack that
# holds what must stay busy), and what the refusal says. Every declared option has one.
BadKeys = Callable[[Path, contextlib.ExitStack], dict[str, object]]


def keys(**values: object) -> BadKeys:
    return lambda tmp_path, stack: values


def a_regular_file(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file"


BAD_VALUES: dict[str, tuple[BadKeys, str]] = {
    "input": (keys(input="missing/*.parquet"), "missing"),
    "prompt_column": (keys(prompt_column="nope"), "nope"),
    "messages_column": (keys(messages_column="nope"), "nope"),
    "token_ids_column": (keys(token_ids_column="nope"), "nope"),
    "id_column": (keys(id_column="nope"), "nope"),
    "chat_template_kwargs": (keys(chat_template_kwargs="text"), "job key 'chat_template_kwargs'"),
    "thinking": (keys(thinking="yes"), "job key 'thinking'"),
    "output": (
        lambda tmp_path, stack: {"output": str(a_regular_file(tmp_path))},
        "exists and is not a directory",
    ),
    # An object-store output's claims_dir under a file: tests/io/test_object_storage.py.
    "claims_dir": (keys(claims_dir=LONG_NAME), "claims_dir path"),
    "logprobs": (keys(logprobs=21), "job key 'logprobs'"),
    "prompt_logprobs": (keys(prompt_logprobs=21), "job key 'prompt_logprobs'"),
    "reasoning_parser": (keys(reasoning_parser="qwen4"), "job key 'reasoning_parser'"),
    "overwrite": (keys(overwrite="yes"), "job key 'overwrite'"),
    "rows_per_part": (keys(rows_per_part=0), "job key 'rows_per_part'"),
    "part_seconds": (keys(part_seconds=0), "job key 'part_seconds'"),
    "target": (keys(target="no-such-model"), "target model directory"),
    "draft": (keys(draft="no-such-draft"), "draft model directory"),
    "speculative_method": (keys(speculative_method="Bad-Name"), "job key 'speculative_method'"),
    "max_constraint_bytes": (keys(max_constraint_bytes=0), "job key 'max_constraint_bytes'"),
    "grammar_compile_timeout": (
        keys(grammar_compile_timeout=0),
        "job key 'grammar_compile_timeout'",
    ),
    "dtype": (keys(dtype="int8"), "job key 'dtype'"),
    "device": (keys(device="tpu"), "job key 'device'"),
    "attention_backend": (keys(attention_backend="xformers"), "job key 'attention_backend'"),
    "kv_cache_dtype": (keys(kv_cache_dtype="int4"), "job key 'kv_cache_dtype'"),
    "cuda_graphs": (keys(cuda_graphs="yes"), "job key 'cuda_graphs'"),
    "prefix_caching": (keys(prefix_caching="yes"), "job key 'prefix_caching'"),
    "verify_width": (keys(verify_width=0), "job key 'verify_width'"),
    "max_batch_size": (keys(max_batch_size=0), "job key 'max_batch_size'"),
    "max_batched_tokens": (keys(max_batched_tokens=0), "job key 'max_batched_tokens'"),
    "prefill_beside_decode": (
        keys(prefill_beside_decode=0),
        "job key 'prefill_beside_decode'",
    ),
    "gpu_memory_fraction": (keys(gpu_memory_fraction=2), "job key 'gpu_memory_fraction'"),
    "max_tokens": (keys(max_tokens=0), "job key 'max_tokens'"),
    "temperature": (keys(temperature=-1), "job key 'temperature'"),
    "top_p": (keys(top_p=2), "job key 'top_p'"),
    "top_k": (keys(top_k=-1), "job key 'top_k'"),
    "seed": (keys(seed=2**64), "job key 'seed'"),
    "stop": (keys(stop=[1]), "job key 'stop'"),
    "stop_token_ids": (keys(stop_token_ids=["a"]), "job key 'stop_token_ids'"),
    "n": (keys(n=0), "job key 'n'"),
    "ignore_eos": (keys(ignore_eos="yes"), "job key 'ignore_eos'"),
    "max_thinking_tokens": (keys(max_thinking_tokens=-1), "job key 'max_thinking_tokens'"),
    "presence_penalty": (keys(presence_penalty=3), "job key 'presence_penalty'"),
    "frequency_penalty": (keys(frequency_penalty=3), "job key 'frequency_penalty'"),
    "repetition_penalty": (keys(repetition_penalty=-1), "job key 'repetition_penalty'"),
    "min_tokens": (keys(min_tokens=-1), "job key 'min_tokens'"),
    "logit_bias": (keys(logit_bias=Toml('{ "999999" = 1.0 }')), "job key 'logit_bias'"),
    "min_p": (keys(min_p=2), "job key 'min_p'"),
    "json_schema": (keys(json_schema=5), "job key 'json_schema'"),
    "regex": (keys(regex="("), "job key 'regex'"),
    "choice": (keys(choice=[]), "job key 'choice'"),
    "schedule_window": (keys(schedule_window=-1), "job key 'schedule_window'"),
    "tp": (keys(tp=0), "job key 'tp'"),
    "shard": (keys(shard="2/2"), "job key 'shard'"),
    "workers": (keys(workers=0), "job key 'workers'"),
    "devices": (keys(devices="0"), "--devices needs --workers N above 1"),
    "quiet": (keys(quiet="yes"), "job key 'quiet'"),
    "metrics_port": (
        lambda tmp_path, stack: {"metrics_port": listening_port(stack)},
        "is in use",
    ),
    "metrics_host": (
        lambda tmp_path, stack: {"metrics_host": "256.1.1.1", "metrics_port": free_port()},
        "metrics host '256.1.1.1' does not resolve",
    ),
    "metrics_file": (
        lambda tmp_path, stack: {"metrics_file": str(tmp_path)},
        "cannot be written: it is a directory",
    ),
    "metrics_file-under-a-file": (
        lambda tmp_path, stack: {"metrics_file": str(a_regular_file(tmp_path) / "m.prom")},
        "is not a directory",
    ),
    # --workers N: worker I's port P + I and file NAME-I.prom, checked before any starts.
    "workers-metrics_port": (
        lambda tmp_path, stack: {
            "workers": 2,
            "device": "cpu",
            "metrics_port": listening_port(stack) - 1,
        },
        "is in use",
    ),
    "workers-metrics_file": (
        lambda tmp_path, stack: {
            "workers": 2,
            "device": "cpu",
            "metrics_file": str((tmp_path / "m-1.prom").mkdir() or tmp_path / "m.prom"),
        },
        "m-1.prom' cannot be written: it is a directory",
    ),
}


def test_every_declared_option_has_a_bad_value() -> None:
    declared = {option.key for option in job_options()}
    assert declared <= set(BAD_VALUES), declared - set(BAD_VALUES)


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_validate_refuses_each_bad_value_in_run_s_line(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    write_input(tmp_path / "in")
    bad, message = BAD_VALUES[case]
    with contextlib.ExitStack() as stack:
        values: dict[str, object] = {
            "input": "in",
            "output": "out",
            "target": str(tiny_model),
            "quiet": True,
            **bad(tmp_path, stack),
        }
        job = tmp_path / "job.toml"
        job.write_text("".join(f"{key} = {toml_value(v)}\n" for key, v in values.items()))
        assert_refused_alike([str(job)], message, tmp_path / "out", monkeypatch)
