"""Each draft's chance to be accepted in a replay, by row and output position: the job
benchmark's changing-acceptance scenarios (bench/oracle.py), its oracle at a tau, and constant
ones."""

from __future__ import annotations

from batchrun.bench.oracle import SCENARIOS as CHANGING_ACCEPTANCE
from batchrun.bench.replay.job import Acceptance, Job
from batchrun.bench.replay.step import BLOCK
from batchrun.bench.sweep import geometric_acceptance


def per_draft(tau: float) -> float:
    """The chance per draft at which a full block commits tau tokens a round."""
    return geometric_acceptance(tau, BLOCK)[0]


def scenario(name: str, job: Job) -> Acceptance:
    """A scenario's acceptance: a changing one of bench/oracle.py, "tau <t>" (the oracle's
    constant chance), "useless" (a drafter that accepts nothing) or the demo drafter's."""
    if name in CHANGING_ACCEPTANCE:
        rule = CHANGING_ACCEPTANCE[name]

        def piecewise(row: int, pos: int) -> float:
            early, late, switch = rule(row, job.rows, job.max_tokens)
            return early if pos < switch else late

        return piecewise
    if name.startswith("tau "):
        p = per_draft(float(name.removeprefix("tau ")))
        return lambda row, pos: p
    half_rows = job.rows // 2
    return {
        "useless": lambda row, pos: 0.0,
        # The demo drafter on greedy rows (its first positions), and the demo job whose second
        # half of rows runs at temperature 2 (batchrun bench --demo-policy): all in one batch.
        "demo greedy": lambda row, pos: 0.7,
        "demo half hot": lambda row, pos: 0.7 if row < half_rows else 0.0,
    }[name]
