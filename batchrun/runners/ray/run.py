"""`batchrun run JOB --ray [ADDRESS]`: one job over a Ray cluster, with Ray Data as the engine.

    read      ray.data.from_items(row groups with rows to do) -> map_batches(read_row_groups)
    generate  map_batches(BatchrunProcessor): an actor pool, one actor per GPU (--replicas)
    commit    this process (the driver, committer.py): parts and progress, then the sink's finish

Exactly once per input row, as in a local run, because only the driver writes the output, under
its claim, through the output sink every runner writes with (batchrun.io.output.sink):
- each row carries its row_index from the read stage, numbered as a local run numbers it (files
  sorted by path, rows in file order); row groups whose rows are all committed are not read, and
  committed rows of the others are dropped as they are read;
- a row is done when a committed part holds it. An actor that dies mid-batch returns nothing for
  that batch; Ray restarts the actor and runs the batch again, so its rows come once more;
- the driver drops any row it already has (a batch that Ray ran twice) and passes a row's n
  samples on together (committer.py).
The driver reads the input's footers and the models' config files, and the actors read the input
and the models: their paths must be the same on every node (a shared filesystem). The output
directory is written by the driver alone.

Why not ray.data.read_parquet: its blocks do not say where in a file their rows are, and the row
index (resume, seeds, the output's row_index) must be the local run's. The read stage reads the
same Parquet row groups with pyarrow inside Ray tasks instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.io.input.listing import resolve_input_paths
from batchrun.io.input.openai_batch import is_request_file
from batchrun.io.input.prompts import PromptColumn, find_prompt_column
from batchrun.io.input.reader import open_input
from batchrun.io.input.row_tokens import sample_row_tokens
from batchrun.io.output.stats import RunClock
from batchrun.io.store import is_uri
from batchrun.runners.engine_feed import QUEUE_FACTOR
from batchrun.runners.opened_job import OpenedJob, open_job
from batchrun.runners.ray.committer import commit_outputs
from batchrun.runners.ray.errors import job_error
from batchrun.runners.ray.processor import ROW_INDEX, BatchrunProcessor, processor_settings
from batchrun.runners.row_sources import RowGroups

CRASH_ONCE_ENV = "BATCHRUN_TEST_RAY_CRASH_ONCE"  # test hook: see BatchrunProcessor._crash_once
READ_BATCH_ROWS = 1024  # rows per block of the read stage


def import_ray() -> Any:
    try:
        import ray
        import ray.data
    except ImportError:
        raise JobError("--ray needs Ray: pip install 'batchrun[ray]'") from None
    return ray


def check_ray_job(job: JobSpec) -> None:
    """What --ray does not run, each refused in one line before Ray is imported or started."""
    if job.run.shard is not None:
        raise JobError("--ray runs every row of the job; leave out shard")
    if job.run.metrics_port is not None or job.run.metrics_file is not None:
        raise JobError("metrics_port and metrics_file are a local run's; Ray exports its own")
    if is_uri(job.input.path) or is_uri(job.output.directory):
        raise JobError("--ray reads and writes local or shared paths, not object storage")
    batch_files = [
        path
        for path in resolve_input_paths(job.input.path, job.output.directory)
        if is_request_file(Path(path.name))
    ]
    if batch_files:  # the read stage reads Parquet row groups (read_row_groups)
        raise JobError(
            f"--ray reads Parquet inputs only, and {str(batch_files[0])!r} is an OpenAI Batch "
            "file: run it without --ray (--workers runs several engines on this node)"
        )


def run_job_ray(
    job: JobSpec, address: str | None = None, replicas: int | None = None
) -> dict[str, Any]:
    """Run the job on the Ray cluster at `address` (None: the one this machine or RAY_ADDRESS
    names, else a new local one) with `replicas` engine actors (None: one per GPU, or 1 without
    GPUs); returns its stats.json content. Raises JobError."""
    check_ray_job(job)
    ray = import_ray()
    if replicas is not None and replicas < 1:
        raise JobError(f"--replicas must be at least 1, got {replicas}")
    clock = RunClock()
    # These checks need no cluster.
    source = open_input(job.input.path, exclude=Path(job.output.directory))
    prompt = find_prompt_column(source.schema, job.input)
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING)
    gpus = int(ray.cluster_resources().get("GPU", 0)) if job.engine.device != "cpu" else 0
    resources: dict[str, Any] = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    found = _probe(ray, job, prompt, resources)
    if job.engine.dtype == "auto":  # the fingerprint holds the dtype the actors resolve, not ours
        engine = dataclasses.replace(job.engine, dtype=found["dtype"])
        job = dataclasses.replace(job, engine=engine)
    # Every actor runs the batch the probe chose (a batch is in no fingerprint).
    engine = dataclasses.replace(job.engine, max_batch_size=found["max_batch_size"])
    job = dataclasses.replace(job, engine=engine)
    opened = open_job(job)
    count = replicas or max(gpus, 1)

    def outputs(done: np.ndarray) -> Iterable[pa.Table]:
        dataset = _dataset(ray, opened, done, count, resources, found["max_batch_size"])
        batches: Iterable[pa.Table] = dataset.iter_batches(batch_format="pyarrow", batch_size=None)
        return batches

    clock.engine_ready()  # the actors load their models within generation_seconds
    return commit_outputs(opened, found, clock, outputs, {"replicas": count})


def _probe(
    ray: Any, job: JobSpec, prompt: PromptColumn, resources: dict[str, Any]
) -> dict[str, Any]:
    """The start-up checks of preflight, run where an actor runs (a GPU node if actors get
    GPUs): what device, dtype and backend the actors will resolve."""
    task = ray.remote(max_retries=0, **resources)(preflight_info)
    try:
        found: dict[str, Any] = ray.get(task.remote(job, prompt))
    except Exception as exc:
        error = job_error(exc)
        if error is None:
            raise
        raise error from None
    return found


def preflight_info(job: JobSpec, prompt: PromptColumn) -> dict[str, Any]:
    """What commit_outputs needs to know of the engine, found by preflight (no weights)."""
    from batchrun.attention.kv_dtype import kv_dtype
    from batchrun.config.preflight import preflight

    source = open_input(job.input.path, exclude=Path(job.output.directory))
    rows = partial(sample_row_tokens, source, range(source.total_rows), prompt, job.row_defaults())
    found = preflight(job, prompt, rows)
    return {
        "target": job.engine.target,
        "draft": job.engine.draft,
        "device": str(found.device),
        "dtype": str(found.dtype).removeprefix("torch."),
        "attention_backend": found.attention_backend,
        "kv_cache_dtype": str(kv_dtype(job.engine.kv_cache_dtype, found.dtype)).removeprefix(
            "torch."
        ),
        "block_size": found.block_size,
    } | found.batch.record()


def read_row_groups(units: pa.Table) -> Iterator[pa.Table]:
    """The read stage: the rows of each unit (one row group) that are not done, with their
    row_index column; one table per READ_BATCH_ROWS rows read."""
    for read in RowGroups(units.to_pylist(), READ_BATCH_ROWS).batches():
        table = pa.Table.from_batches([read.batch])
        yield table.append_column(ROW_INDEX, pa.array(read.row_indices))


def _dataset(
    ray: Any,
    opened: OpenedJob,
    done: np.ndarray,
    replicas: int,
    resources: dict[str, Any],
    batch: int,
) -> Any:
    """The read and generate stages over the rows not done, `batch` requests in flight in each
    actor."""
    ray.data.DataContext.get_current().enable_progress_bars = False  # batchrun draws its own
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # not each dataset's plan
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    settings = processor_settings(opened.job)
    crash = os.environ.get(CRASH_ONCE_ENV)
    if crash:
        settings["_crash_once"] = crash
    reads = ray.data.from_items(RowGroups.plan(opened.source, done)).map_batches(
        read_row_groups, batch_size=1, batch_format="pyarrow", num_cpus=0
    )
    # Ray Data restarts an actor that dies (max_restarts=-1) and runs its batch again
    # (max_task_retries=-1): its defaults for actor pools.
    return reads.map_batches(
        BatchrunProcessor,
        fn_constructor_kwargs=settings,
        batch_size=QUEUE_FACTOR * batch,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=replicas),
        **resources,
    )
