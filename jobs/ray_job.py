"""Run one batchrun job on a Ray cluster, with Ray Data as the engine: Ray tasks read the input's
row groups, an actor pool (one actor per GPU) generates, and this script, the driver, commits the
output directory's parts, stats.json and _SUCCESS exactly as a local run would.

    pip install 'batchrun[ray]'
    python jobs/ray_job.py                                    # the demo job, local Ray instance
    python jobs/ray_job.py jobs/example.toml --address auto   # on this machine's Ray cluster
    ray job submit --working-dir . -- python jobs/ray_job.py jobs/example.toml --output /shared/out

Every node needs batchrun (a --working-dir upload or an install) and the job's input and models
at the same paths (a shared filesystem); the output directory is written by the driver alone, so
with `ray job submit` (which needs the dashboard: pip install 'ray[default]') give it an
--output on storage that outlives the job. A run that stops resumes where it stopped when run
again; an actor that dies has its batch redone by Ray, with no row lost or written twice.
`batchrun run JOB --ray [ADDRESS]` does the same from the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchrun.config.job import load_job
from batchrun.errors import JobError
from batchrun.runners.ray.run import run_job_ray

DEMO_JOB = Path(__file__).resolve().parent / "demo.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("job_file", nargs="?", default=str(DEMO_JOB), help="a job file (TOML)")
    parser.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, this machine's)")
    parser.add_argument("--replicas", type=int, help="engine actors (default: one per GPU)")
    parser.add_argument("--output", help="the output directory, instead of the job file's")
    args = parser.parse_args(argv)
    try:
        job = load_job(Path(args.job_file), {"output": args.output, "quiet": True})
        stats = run_job_ray(job, args.address, args.replicas)
    except JobError as exc:
        print(f"batchrun: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"batchrun: {stats['rows']} rows ({stats['ok_rows']} ok, {stats['error_rows']} errors), "
        f"{stats['completion_tokens']} completion tokens, {stats['ray']['replicas']} replicas "
        f"-> {job.output.directory}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
