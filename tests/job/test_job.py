"""The job spec: defaults < job file < flags, path resolution, schema validation."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from batchrun.config.job import JobSpec, load_job
from batchrun.engine.core.requests import row_seed
from batchrun.errors import JobError
from batchrun.sampling.params import SamplingParams


def write_job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "jobs" / "job.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


BASE = 'input = "data/*.parquet"\noutput = "out"\ntarget = "/models/qwen"\n'


def test_defaults_and_relative_paths_resolve_against_the_job_file(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, BASE))
    jobs_dir = tmp_path / "jobs"
    assert job.input.path == str(jobs_dir / "data/*.parquet")
    assert job.output.directory == str(jobs_dir / "out")
    assert job.engine.target == "/models/qwen"  # absolute paths stay
    assert job.engine.draft is None
    assert (
        job.sampling.max_tokens,
        job.sampling.temperature,
        job.sampling.top_p,
        job.sampling.top_k,
        job.sampling.seed,
    ) == (
        256,
        0.0,
        1.0,
        0,
        0,
    )
    assert (job.sampling.stop, job.sampling.stop_token_ids) == ((), ())
    assert (job.output.rows_per_part, job.output.part_seconds, job.engine.cuda_graphs) == (
        1000,
        60.0,
        True,
    )


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path: Path) -> None:
    path = write_job(tmp_path, BASE + 'max_tokens = 32\ntemperature = 1\nstop = ["\\n\\n"]\n')
    job = load_job(path, {"max_tokens": 8, "temperature": None, "output": "elsewhere"})
    assert job.sampling.max_tokens == 8
    assert job.sampling.temperature == 1.0 and isinstance(job.sampling.temperature, float)
    assert job.sampling.stop == ("\n\n",)
    assert job.output.directory == "elsewhere"  # flags are relative to the working directory


def test_flags_alone_make_a_job() -> None:
    job = load_job(None, {"input": "in.parquet", "output": "out", "target": "m", "draft": "none"})
    assert job.engine.draft is None


def test_draft_none_in_a_file_is_not_a_path(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, BASE + 'draft = "none"\n'))
    assert job.engine.draft is None
    job = load_job(write_job(tmp_path, BASE + 'draft = "d"\n'))
    assert job.engine.draft == str(tmp_path / "jobs" / "d")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("colour = 'red'\n", "unknown job key 'colour'"),
        ("max_tokens = 0\n", "job key 'max_tokens'"),
        ("max_tokens = 'many'\n", "job key 'max_tokens'"),
        ("top_p = 1.5\n", "job key 'top_p'"),
        ("temperature = -1\n", "job key 'temperature'"),
        ("dtype = 'bf16'\n", "job key 'dtype'"),
        ("stop = 'x'\n", "job key 'stop'"),
        ("shard = '1-4'\n", "job key 'shard'"),
        ("shard = '4/4'\n", "job key 'shard'"),
        ("cuda_graphs = 1\n", "job key 'cuda_graphs'"),
    ],
)
def test_bad_keys_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(JobError, match=message) as info:
        load_job(write_job(tmp_path, BASE + extra))
    assert "\n" not in str(info.value)


def test_missing_required_key_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="'target' is required.*--target"):
        load_job(write_job(tmp_path, 'input = "a"\noutput = "b"\n'))


def test_unreadable_or_invalid_job_file(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="cannot read job file"):
        load_job(tmp_path / "missing.toml")
    with pytest.raises(JobError, match="not valid TOML"):
        load_job(write_job(tmp_path, "input = \n"))


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(JobError, match="job key 'rows_per_part'"):
        JobSpec.from_keys(dict(input="a", output="b", target="c", rows_per_part=0))


def test_engine_config_and_default_params() -> None:
    job = JobSpec.from_keys(
        dict(
            input="a",
            output="b",
            target="t",
            draft="d",
            dtype="float32",
            max_batch_size=8,
            max_batched_tokens=128,
            cuda_graphs=False,
            temperature=0.5,
            top_k=4,
            seed=7,
            stop=("x",),
            stop_token_ids=(3,),
            shard="1/4",
        )
    )
    config = job.engine_config()
    assert (config.target, config.draft) == (Path("t"), Path("d"))
    assert (config.dtype, config.max_batch_size, config.max_batched_tokens) == ("float32", 8, 128)
    assert config.cuda_graphs is False
    assert job.default_params() == SamplingParams(
        max_tokens=256, temperature=0.5, top_k=4, seed=7, stop=("x",), stop_token_ids=(3,)
    )
    assert job.default_params(row_index=5).seed == row_seed(7, 5)
    assert job.run.shard_spec == (1, 4)


def test_repeated_flags_arrive_as_tuples_and_load(tmp_path: Path) -> None:
    # click hands a repeatable flag over as a tuple; the schema's arrays must accept it.
    job = load_job(write_job(tmp_path, BASE), {"stop": ("foo", "bar"), "stop_token_ids": (5,)})
    assert (job.sampling.stop, job.sampling.stop_token_ids) == (("foo", "bar"), (5,))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("temperature = nan\n", "temperature must be a finite number"),
        ("temperature = inf\n", "temperature must be a finite number"),
        ("top_p = nan\n", "top_p must be in"),
    ],
)
def test_sampling_defaults_the_engine_refuses_are_refused_at_load(
    tmp_path: Path, extra: str, message: str
) -> None:
    # The schema lets NaN and inf through; the job is held to the engine's own check.
    with pytest.raises(JobError, match=message) as info:
        load_job(write_job(tmp_path, BASE + extra))
    assert "\n" not in str(info.value)
    with pytest.raises(JobError, match=message):
        JobSpec.from_keys(dict(input="a", output="b", target="c", **tomllib.loads(extra)))


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63, 2**64 - 1])
def test_every_seed_in_the_contract_range_is_a_job_seed(tmp_path: Path, seed: int) -> None:
    assert load_job(write_job(tmp_path, f"{BASE}seed = {seed}\n")).sampling.seed == seed
    assert (
        load_job(None, {"input": "x", "output": "o", "target": "m", "seed": seed}).sampling.seed
        == seed
    )


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (-(2**63) - 1, "less than the minimum of -9223372036854775808"),
        (2**64, "greater than the maximum of 18446744073709551615"),
    ],
)
def test_a_seed_past_the_range_is_refused(tmp_path: Path, seed: int, message: str) -> None:
    with pytest.raises(JobError, match=f"job key 'seed': {seed} is {message}"):
        load_job(write_job(tmp_path, f"{BASE}seed = {seed}\n"))


def test_minus_one_and_2_64_minus_1_seed_rows_alike() -> None:
    keys = {"input": "x", "output": "o", "target": "m"}
    low, high = (
        JobSpec.from_keys(dict(**keys, seed=-1)),
        JobSpec.from_keys(dict(**keys, seed=2**64 - 1)),
    )
    assert [low.default_params(i).seed for i in range(5)] == [
        high.default_params(i).seed for i in range(5)
    ]


NAME = "n" * 300  # longer than the 255 bytes every common filesystem allows a name


@pytest.mark.parametrize(
    ("key", "path", "message"),
    [
        ("output", NAME, "File name too long"),
        ("output", f"new/{NAME}/out", "a name of 300 bytes is longer than the 255"),
        ("input", f"{NAME}/*.parquet", "File name too long"),
        ("target", "x/" * 3000, "File name too long"),
    ],
)
def test_a_path_the_filesystem_cannot_name_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, path: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    flags = {"input": "in", "output": "out", "target": "model", key: path}
    with pytest.raises(
        JobError, match=f"^{key} path '.*' \\({len(path)} characters\\): .*{message}"
    ):
        load_job(None, flags)


def test_paths_that_can_exist_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    long_glob = "*" * 300 + ".parquet"  # a pattern, not a name: it may match short names
    flags = {"input": f"data/{long_glob}", "output": "a/b/c", "target": "n" * 255}
    assert load_job(None, flags).output.directory == "a/b/c"
