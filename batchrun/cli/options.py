"""The job flags of `run` and `validate`, derived from the options' declarations: one flag per
declared job key with a help text (underscores become dashes), typed by the option's kind."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from batchrun.config.job import JobSpec, load_job
from batchrun.config.options import JobOption, job_options
from batchrun.runners.shard_env import apply_env_shard
from batchrun.sampling.option import Kind


def _verify_width(value: str | None) -> int | str | None:
    if value is None or value in ("auto", "full"):
        return value
    if value.isdigit():
        return int(value)
    raise click.BadParameter(f"expected auto, full or a positive integer, got {value!r}")


def _json_object(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"expected a JSON object, got {value!r}")
    return parsed


def _callback(parse: Callable[[Any], Any]) -> dict[str, Any]:
    return {"callback": lambda _ctx, _param, value: parse(value)}


# Flags whose values the command line spells its own way.
_SPELLED: dict[str, dict[str, Any]] = {
    "verify_width": _callback(_verify_width),
    # An optional K (alone: 0), so its off switch is a flag of its own (--no-prompt-logprobs).
    "prompt_logprobs": {"type": int, "is_flag": False, "flag_value": 0},
}

_KIND_FLAG: dict[Kind, dict[str, Any]] = {
    Kind.INT: {"type": int},
    Kind.FLOAT: {"type": float},
    Kind.STRINGS: {"multiple": True},
    Kind.TOKEN_IDS: {"type": int, "multiple": True},
    Kind.OBJECT: _callback(_json_object),
}


def _default_text(option: JobOption) -> str:
    """What the key is when the flag and the job file leave it unset."""
    if option.required:
        return "[required, here or in the job file]"
    return f"[default: {option.default_text}]"


def job_flag(option: JobOption) -> Callable[[Any], Any]:
    """The click option of one job key. Flags default to None (unset, so a job file's value
    stands); the help states the key's own default."""
    spec = option.spec
    dashed = option.key.replace("_", "-")
    help_text = f"{spec.help or ''}  {_default_text(option)}".strip()
    settings: dict[str, Any] = {"help": help_text, "metavar": spec.metavar}
    if spec.kind is Kind.BOOL:
        if spec.negatable:
            return click.option(f"--{dashed}/--no-{dashed}", option.key, default=None, **settings)
        return click.option(f"--{dashed}", option.key, is_flag=True, default=None, **settings)
    if spec.flag_choices:
        settings["type"] = click.Choice(list(spec.schema["enum"]))
    settings |= _KIND_FLAG.get(spec.kind, {}) | _SPELLED.get(option.key, {})
    return click.option(f"--{dashed}", option.key, **settings)


def _flags() -> list[Callable[[Any], Any]]:
    flags = []
    for option in job_options():
        if option.spec.help is None:
            continue  # a job key only
        flags.append(job_flag(option))
        if option.key == "prompt_logprobs":
            flags.append(
                click.option(
                    "--no-prompt-logprobs",
                    is_flag=True,
                    default=None,
                    help="No prompt log-probabilities (turns off a job file's prompt_logprobs).",
                )
            )
    return flags


def job_flags(command: Any) -> Any:
    """Add every job flag to a command, in job-key order."""
    for flag in reversed(_flags()):
        command = flag(command)
    return command


def flag_overrides(flags: dict[str, Any]) -> dict[str, Any]:
    """The job keys that flags set (None: unset), from a command's job flag values."""
    # An unrepeated multi-value flag arrives as () and means "not set".
    overrides = {
        key: (value or None) if isinstance(value, tuple) else value for key, value in flags.items()
    }
    if overrides.pop("no_prompt_logprobs"):
        if overrides["prompt_logprobs"] is not None:
            raise click.UsageError("--prompt-logprobs and --no-prompt-logprobs contradict")
        overrides["prompt_logprobs"] = False
    return overrides


def job_of(job_file: Path | None, flags: dict[str, Any]) -> JobSpec:
    """The job of a job file and a command's job flags, with a shard from the environment
    (Slurm, torchrun) where none is set."""
    return apply_env_shard(load_job(job_file, flag_overrides(flags)), os.environ)
