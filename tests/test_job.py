"""The job spec: defaults < job file < flags, path resolution, schema validation."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from batchrun.engine.request import SamplingParams, row_seed
from batchrun.errors import JobError
from batchrun.job import JobSpec, load_job


def write_job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "jobs" / "job.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


BASE = 'input = "data/*.parquet"\noutput = "out"\ntarget = "/models/qwen"\n'


def test_defaults_and_relative_paths_resolve_against_the_job_file(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, BASE))
    jobs_dir = tmp_path / "jobs"
    assert job.input == str(jobs_dir / "data/*.parquet")
    assert job.output == str(jobs_dir / "out")
    assert job.target == "/models/qwen"  # absolute paths stay
    assert job.draft is None
    assert (job.max_tokens, job.temperature, job.top_p, job.top_k, job.seed) == (
        256,
        0.0,
        1.0,
        0,
        0,
    )
    assert (job.stop, job.stop_token_ids) == ((), ())
    assert (job.rows_per_part, job.part_seconds, job.cuda_graphs) == (1000, 60.0, True)


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path: Path) -> None:
    path = write_job(tmp_path, BASE + 'max_tokens = 32\ntemperature = 1\nstop = ["\\n\\n"]\n')
    job = load_job(path, {"max_tokens": 8, "temperature": None, "output": "elsewhere"})
    assert job.max_tokens == 8
    assert job.temperature == 1.0 and isinstance(job.temperature, float)
    assert job.stop == ("\n\n",)
    assert job.output == "elsewhere"  # flags are relative to the working directory


def test_flags_alone_make_a_job() -> None:
    job = load_job(None, {"input": "in.parquet", "output": "out", "target": "m", "draft": "none"})
    assert job.draft is None


def test_draft_none_in_a_file_is_not_a_path(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, BASE + 'draft = "none"\n'))
    assert job.draft is None
    job = load_job(write_job(tmp_path, BASE + 'draft = "d"\n'))
    assert job.draft == str(tmp_path / "jobs" / "d")


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
        JobSpec(input="a", output="b", target="c", rows_per_part=0)


def test_engine_config_and_default_params() -> None:
    job = JobSpec(
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
    config = job.engine_config()
    assert (config.target, config.draft) == (Path("t"), Path("d"))
    assert (config.dtype, config.max_batch_size, config.max_batched_tokens) == ("float32", 8, 128)
    assert config.cuda_graphs is False
    assert job.default_params() == SamplingParams(
        max_tokens=256, temperature=0.5, top_k=4, seed=7, stop=("x",), stop_token_ids=(3,)
    )
    assert job.default_params(row_index=5).seed == row_seed(7, 5)
    assert job.shard_spec == (1, 4)


def test_repeated_flags_arrive_as_tuples_and_load(tmp_path: Path) -> None:
    # click hands a repeatable flag over as a tuple; the schema's arrays must accept it.
    job = load_job(write_job(tmp_path, BASE), {"stop": ("foo", "bar"), "stop_token_ids": (5,)})
    assert (job.stop, job.stop_token_ids) == (("foo", "bar"), (5,))


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
        JobSpec(input="a", output="b", target="c", **tomllib.loads(extra))
