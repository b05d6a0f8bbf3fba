"""What capping the prompt chunks beside decode rows (the engine's prefill_beside_decode) would
do to no-draft jobs of W1's rows (1,024 prompt tokens, 256 new), as the replay prices them with
the cost model fitted to an H100 result file (bench/replay/fitted.py). It explains, it does not
decide: the GPU runs the same jobs (bench/h200_remeasure.sh's stage stall-free).

    python bench/stall_free_replay.py [--fit FILE.json [FILE.json ...]]
        [--jobs 256x128,256x256,1024x128,64x32] [--caps 256,512,768,1024,2048] [--out FILE.json]

--fit: one call's result files, fitted as one (default: the H100 call that
bench/published.toml's replay-fit-h100-widths table fits, 80bc7aa's).

Jobs are ROWSxBATCH. Prints one line per job and cap and writes them to --out as JSON, with its
provenance (commit, device, command).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from batchrun.bench.provenance import provenance
from batchrun.bench.replay.fitted import fit_file, load_call
from batchrun.bench.replay.job import Job, replay
from batchrun.bench.tables import ROOT, table_files

DEFAULT_FIT = table_files("replay-fit-h100-widths")  # the call the docs' second fit table fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", type=Path, nargs="+", default=list(DEFAULT_FIT))
    parser.add_argument("--jobs", default="256x128,256x256,1024x128,64x32")
    parser.add_argument("--caps", default="256,512,768,1024,2048")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    costs = fit_file(load_call(args.fit)).costs
    points = []
    for spec in args.jobs.split(","):
        rows, batch = (int(x) for x in spec.split("x"))
        uncapped = None
        for cap in [None, *(int(c) for c in args.caps.split(","))]:
            job = Job(rows, 1024, 256, batch, prefill_beside_decode=cap)
            played = replay(job, None, 1, costs=costs)
            seconds = played.seconds  # its steps and the job's fixed time, as the fit prices them
            uncapped = uncapped or seconds
            point = {
                "rows": rows,
                "batch": batch,
                "prefill_beside_decode": cap,
                "seconds": seconds,
                "steps": len(played.steps),
                "speedup": uncapped / seconds,
            }
            points.append(point)
            print(point, flush=True)
    if args.out:
        fit = [os.path.relpath(p, ROOT) for p in args.fit]  # as the manifest names them
        result = {"fit": fit, "points": points, "provenance": provenance()}
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
