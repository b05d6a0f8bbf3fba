"""The engine's options are declared once (batchrun/engine/options.py): the engine's config and
the job's engine part are both made of them, so a job's value reaches the engine without a
hand-written copy, and an option added there is a job key and a flag at once."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from batchrun.cli.options import job_flags
from batchrun.config.job import JobSpec
from batchrun.config.options import job_options
from batchrun.config.parts import EnginePart
from batchrun.engine.config import EngineConfig
from batchrun.engine.options import EngineOptions, engine_options
from batchrun.sampling.grammar_compile import CompileBudget

# A value away from the default for every engine option.
SET: dict[str, Any] = {
    "speculative_method": "dflash",
    "max_constraint_bytes": 99,
    "grammar_compile_timeout": 3.0,
    "dtype": "float16",
    "device": "cpu",
    "attention_backend": "torch",
    "kv_cache_dtype": "fp8",
    "cuda_graphs": False,
    "prefix_caching": False,
    "verify_width": "full",
    "max_batch_size": 8,
    "max_batched_tokens": 128,
    "prefill_beside_decode": 64,
    "gpu_memory_fraction": 0.5,
}


def test_every_engine_option_has_a_value_here() -> None:
    names = [item.name for item in dataclasses.fields(EngineOptions)]
    assert names == list(SET)
    assert all(
        SET[name] != item.default
        for name, item in zip(names, dataclasses.fields(EngineOptions), strict=True)
    )


def test_the_engine_config_has_the_declared_defaults() -> None:
    config, part = EngineConfig(target=Path("t")), EnginePart(target="t")
    assert engine_options(config) == engine_options(part)
    assert config.compile_budget == CompileBudget()


def test_a_job_hands_the_engine_every_engine_option() -> None:
    job = JobSpec.from_keys(
        {"input": "in", "output": "out", "target": "t", "draft": "d", "logprobs": 2, **SET}
    )
    config = job.engine_config()
    assert engine_options(config) == SET
    assert config.compile_budget == CompileBudget(3.0, 99)
    assert (config.target, config.draft, config.logprobs) == (Path("t"), Path("d"), 2)


def test_every_engine_option_is_a_job_key_and_a_flag_of_the_engine_part() -> None:
    engine_keys = [option.key for option in job_options() if option.part == "engine"]
    assert engine_keys == ["target", "draft", *SET]  # the models first, as before
    flags = {p.name for p in job_flags(click.command()(lambda **_: None)).params}
    assert set(SET) <= flags
