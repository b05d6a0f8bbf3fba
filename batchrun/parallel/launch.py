"""`batchrun run --tp N`: a job on N tensor-parallel processes of this host.

Outside torchrun the job is checked, then re-executed under torch.distributed.run (standalone
rendezvous on a free port) as N processes of `batchrun.parallel.worker`, each handed the
resolved job. Inside torchrun (the worker, or `torchrun ... -m batchrun.cli run --tp N`) each
process joins its tensor-parallel group and runs the job in lockstep with the group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from batchrun.errors import JobError
from batchrun.job import JobSpec
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.parallel.group import TensorParallel, init_from_env
from batchrun.parallel.sharding import local_shape
from batchrun.pipeline import open_job, run_job

TP_DEVICES = ("auto", "cpu", "cuda")


def device_type(job: JobSpec) -> str:
    """What each rank runs on: one GPU each (NCCL) or the CPU (gloo)."""
    if job.device not in TP_DEVICES:
        raise JobError(
            f"device {job.device!r} with tp {job.tp}: use auto, cuda or cpu "
            "(each rank takes GPU LOCAL_RANK)"
        )
    if job.device == "cpu" or (job.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if job.tp > gpus:
        raise JobError(f"tp {job.tp} needs {job.tp} GPUs (one per rank); this host has {gpus}")
    return "cuda"


def check(job: JobSpec) -> None:
    """The refusals a job with tp meets before any process starts: the target's heads, KV
    heads and MLP rows must split evenly, and there must be a GPU per rank."""
    device_type(job)
    shape = qwen3_shape(read_config(Path(job.target), "target model"))
    local_shape(shape, TensorParallel(0, job.tp, torch.device("cpu")))


def relaunch(job: JobSpec) -> int:
    """Run the job as job.tp torchrun processes; their exit status."""
    check(job)
    open_job(job)  # the input and output checks, said once here rather than by every rank
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={job.tp}", "-m", "batchrun.parallel.worker", json.dumps(job.to_dict()),
    ]  # fmt: skip
    environ = dict(os.environ)
    environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.tp)))
    return subprocess.call(command, env=environ)


def run_rank(job: JobSpec) -> tuple[dict[str, Any], TensorParallel]:
    """This torchrun process's part of the job: its group's, on GPU LOCAL_RANK or the CPU."""
    tp = init_from_env(os.environ, device_type(job), job.tp)
    local_shape(qwen3_shape(read_config(Path(job.target), "target model")), tp)  # one line if not
    stats = run_job(job, tp=tp)
    tp.barrier()  # no rank tears its connections down while another still uses them (gloo aborts)
    dist.destroy_process_group()  # after a failure, torchrun ends the other ranks instead
    return stats, tp
