"""How fast a job of mixed rows (every other row one the drafter never gets right) could run at
best under any width policy, as the replay fitted to a GPU result file prices it: the `auto`
run's replayed steps, each priced as if its drafts and wider verifies cost nothing (the same
requests, prompt chunks and context, every row at width 1 with no drafter). What remains is the
steps the job cannot shed: a never-right row commits one token a step whatever its width, and
it starts only when a slot frees. It explains a miss, it does not decide.

    python bench/mixed_rows_bound.py [--fit bench/results/jobs-h100-w1-w2-b1-policy.json]
        [--workloads w1,w2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchrun.bench.provenance import provenance
from batchrun.bench.replay.fitted import FittedCosts, RunSpec, fit_file, run_specs
from batchrun.bench.replay.step import ReplayStep


def plain(step: ReplayStep) -> ReplayStep:
    """The step with its drafting free: each decoding row at width 1, no drafter, run eagerly
    on its own rows (no graph's padding)."""
    return replace(
        step,
        widths=(1,) * step.num_decoding,
        drafter=False,
        oracle=False,
        writes_context=False,
        target_graph_rows=0,
        draft_graph_requests=0,
        switched=False,
    )


def _bound(
    result: dict[str, Any], costs: FittedCosts, specs: dict[tuple[str, str], RunSpec], w: str
) -> dict[str, Any]:
    """Workload w's mixed rows runs: measured, replayed and with their drafting free, over none."""
    none = specs[w, "none"].replay(costs)
    measured = result["workloads"][w]["runs"]
    point: dict[str, Any] = {"workload": w, "none_steps": len(none.steps)}
    # auto's own steps, and the full block's (the good rows' fewest: every row at the block)
    for name in ("mixed rows auto", "mixed rows full"):
        spec = specs[w, name]
        played = spec.replay(costs)
        steps = sum(costs.step(plain(s)) for s, _ in played.steps) / 1e3
        free = costs.job_seconds(spec.job.rows) + steps  # the replay's time outside its steps
        point[name] = {
            "measured_over_none": measured["none"]["generation_seconds"]
            / measured[name]["generation_seconds"],
            "replayed_over_none": none.seconds / played.seconds,
            "free_drafting_over_none": none.seconds / free,
            "steps": len(played.steps),
        }
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fit", type=Path, default=Path("bench/results/jobs-h100-w1-w2-b1-policy.json")
    )
    parser.add_argument("--workloads", default="w1,w2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = json.loads(args.fit.read_text())
    costs = fit_file(result).costs
    specs = {(s.workload, s.name): s for s, _ in run_specs(result)}
    points = [_bound(result, costs, specs, w) for w in args.workloads.split(",")]
    print(json.dumps(points, indent=1))
    if args.out:
        out = {"fit": str(args.fit), "points": points, "provenance": provenance()}
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
