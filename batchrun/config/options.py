"""Every option of a job, each declared once on the part that holds it: here they are collected
in job-key order, for the flags (batchrun/cli/options.py), the job's JSON Schema
(config/schema.py) and the job file's reading (config/job.py)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from batchrun.config.parts import EnginePart, InputPart, OutputPart, RunPart, StructuredPart
from batchrun.sampling.option import Option, declared, key_of
from batchrun.sampling.params import SamplingParams

# The job spec's parts, by the name JobSpec holds each under, in the order of the job's keys.
PARTS: tuple[tuple[str, type], ...] = (
    ("input", InputPart),
    ("output", OutputPart),
    ("engine", EnginePart),
    ("sampling", SamplingParams),
    ("structured", StructuredPart),
    ("run", RunPart),
)


def part_types() -> dict[str, type]:
    """The type of each part, by the name JobSpec holds it under."""
    return dict(PARTS)


@dataclass(frozen=True)
class JobOption:
    """One job key: the part (a JobSpec field) and the part's field it sets, its default
    (dataclasses.MISSING for a required key) and its declaration."""

    key: str
    part: str
    field: str
    default: Any
    spec: Option

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def default_text(self) -> str:
        """The default as --help and the docs' tables say it: on/off, a list joined by commas,
        an unset value as its declaration says (else "none")."""
        default = self.default
        if default is None:
            return self.spec.unset or "none"
        if isinstance(default, bool):
            return "on" if default else "off"
        if isinstance(default, tuple):
            return ", ".join(map(str, default)) or "none"
        return str(default)


@functools.cache
def job_options() -> tuple[JobOption, ...]:
    """Every job key, part by part in PARTS order, each part's in field order."""
    return tuple(
        JobOption(key_of(item, spec), part, item.name, item.default, spec)
        for part, cls in PARTS
        for item, spec in declared(cls)
    )


def job_option(key: str) -> JobOption:
    """The declaration of one job key."""
    return next(option for option in job_options() if option.key == key)
