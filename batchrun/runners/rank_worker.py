"""One process of `batchrun run --tp N` under torchrun:
`python -m batchrun.runners.rank_worker JOB`, JOB the resolved job as JSON. Rank 0 prints the
summary line; a JobError is one line on stderr and exit status 2, and a stop by a signal one line
and EXIT_STOPPED, as from `batchrun run`."""

from __future__ import annotations

import json
import sys

from batchrun.config.job import JobSpec
from batchrun.errors import EXIT_STOPPED, JobError, JobStopped
from batchrun.runners.local import summary_line
from batchrun.runners.torchrun import run_rank


def main(argv: list[str]) -> int:
    try:
        job = JobSpec.from_keys(json.loads(argv[1]))
        stats, tp = run_rank(job)
    except JobError as exc:
        print(f"batchrun: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except JobStopped as stop:  # by SIGTERM or SIGINT, as `batchrun run` stops
        if stop.line is not None:  # rank 0's
            print(stop.line, file=sys.stderr)
        return EXIT_STOPPED
    if tp.rank == 0:
        print(summary_line(stats, job.output.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
