"""Where the workers of `batchrun run --workers N` run, and what cannot go with --workers:
checked before any worker starts (batchrun.runners.startup), by validate too."""

from __future__ import annotations

from batchrun.config.job import JobSpec
from batchrun.errors import JobError


def check_workers(job: JobSpec, ray: bool) -> None:
    """JobError (one line) for what cannot go with --workers / --devices."""
    run = job.run
    if run.workers == 1:
        if run.devices is not None:
            raise JobError("--devices needs --workers N above 1 (one device: --device cuda:I)")
        return
    if ray:
        raise JobError("--workers starts processes on this node; with --ray use --replicas")
    if run.tp > 1:
        raise JobError("--workers runs the whole model in each process; not with --tp above 1")
    if run.shard is not None:
        raise JobError(
            "--workers shares the rows between processes through claims; not with --shard "
            "(nor a shard from a Slurm array or torchrun)"
        )


def _visible_gpus() -> int:
    import torch  # only to count GPUs: the parent runs no model

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_devices(job: JobSpec, visible: int | None = None) -> list[str]:
    """The device of each worker: cpu for each, or the CUDA devices of --devices (default every
    visible GPU), the first --workers of them. JobError for a combination that cannot work."""
    workers, device, listed = job.run.workers, job.engine.device, job.run.devices
    if device == "cpu":
        if listed is not None:
            raise JobError("--devices names CUDA devices; not with --device cpu")
        return ["cpu"] * workers
    if device not in ("auto", "cuda"):
        raise JobError(
            f"--device {device} is one device; --workers spreads over --devices (leave "
            "--device at auto or cuda, or use --device cpu)"
        )
    visible = _visible_gpus() if visible is None else visible
    if visible == 0:
        if device == "cuda" or listed is not None:
            raise JobError("--workers: no CUDA device is visible (use --device cpu)")
        return ["cpu"] * workers  # auto without a GPU runs on the CPU, as a single run does
    indices = [int(i) for i in listed.split(",")] if listed is not None else list(range(visible))
    if len(set(indices)) < len(indices):
        raise JobError(f"--devices {listed} names a device twice")
    if max(indices) >= visible:
        raise JobError(f"--devices {listed}: this process sees {visible} CUDA device(s)")
    if workers > len(indices):
        what = f"--devices {listed} lists" if listed is not None else "this node has"
        raise JobError(f"--workers {workers} needs a GPU each; {what} {len(indices)}")
    return [f"cuda:{i}" for i in indices[:workers]]
