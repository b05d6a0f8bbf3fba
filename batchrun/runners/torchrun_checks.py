"""What a job with tp above 1 must meet before any of its processes starts (checked by
batchrun.runners.startup, for validate too): a device each rank can take, and a target whose
heads, KV heads and MLP rows split evenly over the ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.models.qwen3_sharding import local_shape
from batchrun.parallel.group import TensorParallel

TP_DEVICES = ("auto", "cpu", "cuda")


def device_type(job: JobSpec) -> str:
    """What each rank runs on: one GPU each (NCCL) or the CPU (gloo)."""
    if job.engine.device not in TP_DEVICES:
        raise JobError(
            f"device {job.engine.device!r} with tp {job.run.tp}: use auto, cuda or cpu "
            "(each rank takes GPU LOCAL_RANK)"
        )
    if job.engine.device == "cpu" or (
        job.engine.device == "auto" and not torch.cuda.is_available()
    ):
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if job.run.tp > gpus:
        raise JobError(
            f"tp {job.run.tp} needs {job.run.tp} GPUs (one per rank); this host has {gpus}"
        )
    return "cuda"


def check(job: JobSpec) -> None:
    """The refusals a job with tp meets before any process starts: the target's heads, KV
    heads and MLP rows must split evenly, and there must be a GPU per rank."""
    device_type(job)
    shape = qwen3_shape(read_config(Path(job.engine.target), "target model"))
    local_shape(shape, TensorParallel(0, job.run.tp, torch.device("cpu")))
