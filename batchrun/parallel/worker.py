"""One process of `batchrun run --tp N` under torchrun: `python -m batchrun.parallel.worker JOB`,
JOB the resolved job as JSON. Rank 0 prints the summary line; a JobError is one line on stderr
and exit status 2, as from `batchrun run`."""

from __future__ import annotations

import json
import sys

from batchrun.errors import JobError
from batchrun.job import JobSpec
from batchrun.parallel.launch import run_rank
from batchrun.pipeline import summary_line


def main(argv: list[str]) -> int:
    try:
        job = JobSpec(**json.loads(argv[1]))
        stats, tp = run_rank(job)
    except JobError as exc:
        print(f"batchrun: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if tp.rank == 0:
        print(summary_line(stats, job.output))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
