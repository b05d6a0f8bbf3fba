"""Run one batchrun job over a Ray cluster: one shard per GPU task, all into one output directory.

    pip install 'batchrun[ray]'
    python jobs/ray_shards.py jobs/example.toml --shards 8

Each task runs `batchrun run JOB --shard I/N`. Shards resume on their own after a failure, so a
task that Ray retries skips the rows it already committed; the last shard to finish writes
OUT/_SUCCESS.
"""

from __future__ import annotations

import argparse
import subprocess

import ray


@ray.remote(num_gpus=1, max_retries=3)
def run_shard(job_file: str, index: int, count: int) -> int:
    cmd = ["batchrun", "run", job_file, "--quiet", "--shard", f"{index}/{count}"]
    return subprocess.run(cmd, check=True).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job_file")
    parser.add_argument("--shards", type=int, required=True)
    args = parser.parse_args()
    ray.init()
    tasks = [run_shard.remote(args.job_file, i, args.shards) for i in range(args.shards)]
    ray.get(tasks)
    print(f"all {args.shards} shards finished")


if __name__ == "__main__":
    main()
