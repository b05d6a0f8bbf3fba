"""The shard of a job that names none, from the launcher's environment.

- A Slurm array task: shard (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP
  of SLURM_ARRAY_TASK_COUNT (ids need not start at 0: `--array=5-8` is shards 0..3 of 4).
- A torchrun process: shard RANK of WORLD_SIZE; LOCAL_RANK picks its GPU (the device becomes
  cuda:LOCAL_RANK where it is auto or cuda and CUDA is there; a process that sees one GPU only
  keeps it). With tensor parallelism (tp > 1) each tp consecutive ranks are one group that runs
  one shard: shard RANK // tp of WORLD_SIZE // tp (no shard when that is 1 of 1).
- Both (torchrun inside each task of a Slurm array): shard task * WORLD_SIZE + RANK of
  COUNT * WORLD_SIZE, so every process of every task has rows of its own.

A shard given by --shard or the job file wins over the environment. Whatever is taken from the
environment is said in one line on stderr.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO

from batchrun.config.job import JobSpec
from batchrun.errors import JobError

SLURM_KEYS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class EnvShard:
    index: int
    count: int
    origin: str  # the variables it came from, for the log line
    local_rank: int  # torchrun's LOCAL_RANK; -1 without one


def _integer(environ: Mapping[str, str], key: str, minimum: int, default: int | None = None) -> int:
    text = environ.get(key)
    if text is None and default is not None:
        return default
    if text is None:
        raise JobError(f"environment variable {key} is not set (shard from the environment)")
    try:
        value = int(text)
    except ValueError:
        raise JobError(f"environment variable {key}={text!r} is not an integer") from None
    if value < minimum:
        raise JobError(f"environment variable {key}={value} is below {minimum}")
    return value


def _slurm(environ: Mapping[str, str]) -> tuple[int, int, str] | None:
    if not any(key in environ for key in SLURM_KEYS):
        return None
    task = _integer(environ, "SLURM_ARRAY_TASK_ID", 0)
    count = _integer(environ, "SLURM_ARRAY_TASK_COUNT", 1)
    first = _integer(environ, "SLURM_ARRAY_TASK_MIN", 0, default=0)
    step = _integer(environ, "SLURM_ARRAY_TASK_STEP", 1, default=1)
    offset = task - first
    if offset < 0 or offset % step or offset // step >= count:
        raise JobError(
            f"Slurm array task {task} is not one of {count} tasks from {first} in steps of {step}; "
            "use a contiguous --array=MIN-MAX[:STEP] or give --shard"
        )
    origin = f"SLURM_ARRAY_TASK_ID={task}, SLURM_ARRAY_TASK_MIN={first}, "
    origin += f"SLURM_ARRAY_TASK_STEP={step}, " if step != 1 else ""
    return offset // step, count, origin + f"SLURM_ARRAY_TASK_COUNT={count}"


def _torchrun(environ: Mapping[str, str], tp: int) -> tuple[int, int, str] | None:
    if not any(key in environ for key in TORCHRUN_KEYS):
        return None
    rank = _integer(environ, "RANK", 0)
    world = _integer(environ, "WORLD_SIZE", 1)
    if rank >= world:
        raise JobError(f"environment variable RANK={rank} is not below WORLD_SIZE={world}")
    if world % tp:
        raise JobError(f"WORLD_SIZE={world} is not a multiple of the tensor parallel size {tp}")
    origin = f"RANK={rank}, WORLD_SIZE={world}" + (f", tp={tp}" if tp > 1 else "")
    return rank // tp, world // tp, origin


def shard_from_env(environ: Mapping[str, str], tp: int = 1) -> EnvShard | None:
    """The shard the environment gives (None: not launched as an array task or a rank, or one
    tensor-parallel group is all there is)."""
    slurm, torchrun = _slurm(environ), _torchrun(environ, tp)
    if slurm is None and torchrun is not None and torchrun[1] == 1 and tp > 1:
        return None
    local_rank = _integer(environ, "LOCAL_RANK", 0, default=-1) if torchrun else -1
    if slurm is not None and torchrun is not None:
        (task, tasks, slurm_origin), (rank, world, rank_origin) = slurm, torchrun
        index, count = task * world + rank, tasks * world
        return EnvShard(index, count, f"{slurm_origin}; {rank_origin}", local_rank)
    found = slurm or torchrun
    if found is None:
        return None
    index, count, origin = found
    return EnvShard(index, count, origin, local_rank)


def _cuda_devices() -> int:
    import torch  # only for a torchrun process: the CLI does not import torch otherwise

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def apply_env_shard(
    job: JobSpec,
    environ: Mapping[str, str],
    log: TextIO | None = None,
    cuda_devices: Callable[[], int] = _cuda_devices,
) -> JobSpec:
    """The job with its shard (and torchrun's GPU) from the environment, if it names no shard."""
    if job.run.shard is not None:
        return job  # --shard or the job file's shard wins
    found = shard_from_env(environ, job.run.tp)
    if found is None:
        return job
    shard, device = f"{found.index}/{found.count}", job.engine.device
    line = f"batchrun: shard {shard} from {found.origin}"
    # A tensor-parallel group's processes take GPU LOCAL_RANK as they join it (parallel/group.py).
    if found.local_rank >= 0 and job.engine.device in ("auto", "cuda") and job.run.tp == 1:
        devices = cuda_devices()
        if devices > 1:  # one visible GPU: the launcher gave this process its own
            if found.local_rank >= devices:
                raise JobError(
                    f"LOCAL_RANK={found.local_rank} but this process sees {devices} CUDA devices"
                )
            device = f"cuda:{found.local_rank}"
            line += f"; device {device} from LOCAL_RANK={found.local_rank}"
    print(line, file=log or sys.stderr)
    return dataclasses.replace(
        job,
        run=dataclasses.replace(job.run, shard=shard),
        engine=dataclasses.replace(job.engine, device=device),
    )
