"""A replay cost model fitted to a `batchrun bench --jobs` result file: non-negative least
squares over relative errors, each of the file's runs replayed (bench/replay/job.py) with its
workload, its acceptance (no draft, the useless drafter, the oracle at a tau or in a scenario)
and its verify width, and the replay's steps priced from their rows (STEP_PARTS). A run's
equations: its mean step of each kind (step_seconds / steps) or, where the file records them
(`width_seconds`), of each kind at each verify width; the draft's own mean time at each width
(`draft_seconds`), where recorded; and the whole job (generation_seconds, with a part per job
and per row outside the steps: JOB). A run at the adaptive width is replayed under the model
fitted so far, so the fit is repeated until its widths settle (ROUNDS).

The fit's ratios compare the replays as the file's ratios compare the runs, each replay's steps
beside its run's measured time outside them."""

from __future__ import annotations

import functools
import json
import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchrun.bench.ratios import speed_ratios
from batchrun.bench.replay.job import Job, Replay, replay
from batchrun.bench.replay.scenarios import scenario
from batchrun.bench.replay.step import BLOCK, ReplayStep
from batchrun.config.parts import EnginePart

Parts = dict[str, Callable[[ReplayStep], float]]
Rooflines = tuple[tuple[Parts, Parts], ...]

# What a step's milliseconds are made of, a parameter of FittedCosts each: the larger of reading
# the weights (MEMORY) and the rows' matmuls (COMPUTE), a roofline as engine/batch_size.py weighs
# them, plus the work outside both (EXTRA: the decode rows' K/V reads, the verify's own, the
# drafter's, the benchmark oracle's, a change of width). A sum of MEMORY and COMPUTE cannot
# price the H100's verify steps: at width 16 a step of 128 requests costs 3.5x one of 32 (2,048
# and 512 rows), not the 2.7x that a part per step and one per row give, as the matmuls hide the
# weights' reading. They do not hide the K/V reads, which run in the attention kernels apart
# from the matmuls: W1's steps with 512 prompt tokens beside 96 decoding requests took 23.9 ms
# on an H100 against 14.3 for 124 requests' decode alone (bench/results/
# jobs-h100-w1-stall-free-512.json), where a roofline over both had priced them near the latter.
MEMORY: Parts = {
    "weights_ms": lambda s: 1.0,  # the target's weights, read once a step
}
COMPUTE: Parts = {
    "compute_ms": lambda s: 1.0,  # what a compute-bound step spends beside its rows
    "ms_per_row": lambda s: s.target_rows,  # rows the target runs (a graph's padded ones)
}
EXTRA: Parts = {
    "ms_per_kv_token": lambda s: s.context,  # K/V tokens the decoding requests read
    "ms_per_prefill_token": lambda s: s.prefill_rows,  # a prompt's attention, its K/V written
    "verify_ms_per_step": lambda s: float(s.max_width > 1),  # acceptance and commit of drafts
    "context_ms_per_request": lambda s: s.context_writes,  # its context written at width 1,
    "eager_context_ms_per_request": lambda s: s.context_writes * (s.prefill_rows > 0),  # and so
    "context_ms_per_prefill_token": lambda s: s.draft_prefill_rows,  # and over the prompts
    # The benchmark's oracle (its runs only): the target's continuation copied in as drafts.
    "oracle_ms_per_step": lambda s: float(s.oracle and s.drafting > 0),
    "oracle_ms_per_request": lambda s: s.oracle * s.drafting,
    "switch_ms": lambda s: float(s.switched),  # the pipeline's stall at a change of width
}
# The drafter's forward, a roofline of its own (what the draft clock times): reading its weights
# and the target's head (DRAFT_MEMORY) or its blocks' matmuls (DRAFT_COMPUTE). On the H100 it
# takes 1.6 ms for one request, 3.2 for 32 and 11.0 for 128.
DRAFT_MEMORY: Parts = {
    "draft_ms_per_step": lambda s: float(s.drafting > 0),
}
DRAFT_COMPUTE: Parts = {
    "draft_compute_ms": lambda s: float(s.drafting > 0),
    "draft_ms_per_request": lambda s: s.draft_requests,  # a block each (a graph's padded ones)
}
DRAFT_ROOFLINE = ((DRAFT_MEMORY, DRAFT_COMPUTE),)
ROOFLINES = ((MEMORY, COMPUTE), *DRAFT_ROOFLINE)
JOB: dict[str, Callable[[Job], float]] = {  # seconds of a job outside its steps (the first
    "job_fixed_seconds": lambda job: 1.0,  # step, whose period the engine does not count, the
    "job_seconds_per_row": lambda job: job.rows,  # pipeline's start and end)
}
STEP_PARTS = {**MEMORY, **COMPUTE, **DRAFT_MEMORY, **DRAFT_COMPUTE, **EXTRA}
PARAMETERS = (*STEP_PARTS, *JOB)  # the order of an equation's features
CALIBRATION_STEPS = 10  # bisections of an oracle scenario's divergence chance
MAX_HAZARD = 0.004  # per output token (bisected to 4e-6)
START_SCALES = (0.5, 2.0)
ROBUST = 0.05  # relative error beyond which an equation's counts linearly (_weights)
BOUND_ROUNDS = 6  # solves a fit takes to find each step's bound (2 or 3 settle it)
ROUNDS = 6  # fits, the adaptive runs replayed under each: their widths settle in 2 or 3


@dataclass(frozen=True)
class FittedCosts:
    """Milliseconds of a step from its rows (STEP_PARTS), and seconds of a job outside its
    steps (JOB)."""

    weights_ms: float
    ms_per_kv_token: float
    compute_ms: float
    ms_per_row: float
    ms_per_prefill_token: float
    draft_ms_per_step: float
    draft_compute_ms: float
    draft_ms_per_request: float
    verify_ms_per_step: float
    context_ms_per_request: float
    eager_context_ms_per_request: float  # in a step with prefill chunks (no CUDA graph)
    context_ms_per_prefill_token: float
    oracle_ms_per_step: float
    oracle_ms_per_request: float
    switch_ms: float
    job_fixed_seconds: float
    job_seconds_per_row: float

    def _sum(self, parts: Parts, step: ReplayStep) -> float:
        return sum(getattr(self, name) * f(step) for name, f in parts.items())

    def _bound(self, memory: Parts, compute: Parts, step: ReplayStep) -> float:
        return max(self._sum(memory, step), self._sum(compute, step))

    def step(self, step: ReplayStep) -> float:
        rooflines = sum(self._bound(memory, compute, step) for memory, compute in ROOFLINES)
        return rooflines + self._sum(EXTRA, step)

    def draft(self, step: ReplayStep) -> float:
        return self._bound(DRAFT_MEMORY, DRAFT_COMPUTE, step)

    def job_seconds(self, rows: int) -> float:
        return self.job_fixed_seconds + self.job_seconds_per_row * rows

    def features(self, step: ReplayStep, rooflines: Rooflines = ROOFLINES) -> list[float]:
        """The step's part of each step parameter, then 0 for the job's: EXTRA's, and of each
        roofline's two sides only the one that bounds it under these costs (both while neither
        is priced: the first fit, from which the bounds are then found). rooflines: those
        priced (the draft's alone: what the draft clock times)."""
        parts: Parts = {} if rooflines is not ROOFLINES else {**EXTRA}
        for memory, compute in rooflines:
            read, run = self._sum(memory, step), self._sum(compute, step)
            parts.update({**(memory if read >= run else {}), **(compute if run >= read else {})})
        features = [f(step) if name in parts else 0.0 for name, f in STEP_PARTS.items()]
        return features + [0.0] * len(JOB)

    def parameters(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class RunSpec:
    """A result file's run, as the replay runs it."""

    workload: str
    name: str
    job: Job
    scenario: str | None  # None: no draft
    width: int | str  # auto, or a fixed verify width
    hazard: float = 0.0  # each output token's chance that a row diverges (_calibrated)

    def replay(self, costs: FittedCosts) -> Replay:
        if self.scenario is None:
            return replay(self.job, None, self.width, costs=costs)
        chance = scenario(self.scenario, self.job)
        diverges = [_diverges_at(row, self.hazard) for row in range(self.job.rows)]
        return replay(
            self.job, lambda r, p: 0.0 if p >= diverges[r] else chance(r, p), self.width, costs
        )

    def decoding_steps(self) -> int:
        return sum(1 for s, _ in self.replay(_ZERO).steps if s.num_decoding)


@dataclass(frozen=True)
class Fit:
    costs: FittedCosts
    # (workload, run, what) -> (measured, replayed): each equation's milliseconds
    residuals: dict[tuple[str, str, str], tuple[float, float]]
    # (workload, ratio name) -> (measured, replayed): the file's ratios, and the replay's
    ratios: dict[tuple[str, str], tuple[float, float]]


def run_specs(result: dict[str, Any]) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
    """Each run of the file the replay can run (a constrained workload's are left out: the
    replay prices no grammar masks), with its record."""
    budget = EnginePart(target="").max_batched_tokens  # what the bench's jobs ran with
    beside = result.get("setup", {}).get("prefill_beside_decode")
    for wname, entry in result["workloads"].items():
        w = entry["workload"]
        if w.get("json_schema") is not None:
            continue
        job = Job(
            rows=w["rows"],
            prompt_len=round(sum(w["prompt_len"]) / 2),
            max_tokens=round(sum(w["max_tokens"]) / 2),
            batch=w["batch"],
            budget=budget,
            prefill_beside_decode=beside,
        )
        for name, run in entry["runs"].items():
            yield _spec(wname, name, job), run


def _calibrated(
    specs: list[tuple[RunSpec, dict[str, Any]]],
) -> list[tuple[RunSpec, dict[str, Any]]]:
    """The oracle's acceptance as the runs met it: its continuation is another batch shape's
    bf16 arithmetic, and a row whose greedy token differs drafts wrong from there on (bench/
    oracle.py). So a scenario's rows diverge at a chance per output token, found by bisection
    where its full-block replay takes the decoding steps its full-block run took (none where
    the replay takes more at none); its adaptive run is replayed at the same chance."""
    hazards: dict[tuple[str, str | None], float] = {}
    for spec, run in specs:
        if not spec.job.oracle or spec.width != BLOCK:
            continue
        measured = run["steps"].get("decode", 0) + run["steps"].get("mixed", 0)
        low, high = 0.0, MAX_HAZARD  # more steps at a higher chance
        for _ in range(CALIBRATION_STEPS):
            mid = (low + high) / 2
            steps = replace(spec, hazard=mid).decoding_steps()
            low, high = (mid, high) if steps < measured else (low, mid)
        hazards[spec.workload, spec.scenario] = low
    return [(replace(s, hazard=hazards.get((s.workload, s.scenario), 0.0)), r) for s, r in specs]


def _diverges_at(row: int, hazard: float) -> float:
    """The output position from which `row`'s drafts are wrong: geometric at `hazard` per
    token, from one uniform draw per row (a higher hazard never diverges later)."""
    if hazard <= 0:
        return math.inf
    u = random.Random(f"diverge-{row}").random()
    return math.floor(math.log(1 - u) / math.log1p(-hazard))


def _spec(workload: str, name: str, job: Job) -> RunSpec:
    """A run's name (bench/jobs.py's _runs) as the replay's acceptance and width."""
    if name == "none":
        return RunSpec(workload, name, job, None, 1)
    *what, mode = name.split(" ")
    acceptance = " ".join(what).removeprefix("oracle ")
    oracle = replace(job, oracle=acceptance != "useless")
    return RunSpec(workload, name, oracle, acceptance, "auto" if mode == "auto" else BLOCK)


def one_call(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Result files of one call (one commit, device and setup; only their workloads differ)
    as one, for one fit: a file of w2 and b1 leaves unpinned the compute-bound prices that its
    call's w1 pins."""
    first = results[0]
    for other in results[1:]:
        for key in ("commit", "device"):
            if other["provenance"][key] != first["provenance"][key]:
                raise ValueError(f"result files of different calls ({key}) cannot be fitted as one")
        if other["setup"]["prefill_beside_decode"] != first["setup"]["prefill_beside_decode"]:
            raise ValueError("result files of different setups cannot be fitted as one")
    workloads = {w: e for result in results for w, e in result["workloads"].items()}
    return {**first, "workloads": workloads}


def load_call(paths: Sequence[Path]) -> dict[str, Any]:
    """one_call of the result files at `paths`."""
    return one_call([json.loads(Path(p).read_text()) for p in paths])


def fit_file(result: dict[str, Any]) -> Fit:
    """fit_costs, once per file's content in a process: a fit takes about a minute, and the
    published tables and the fit's tests ask for the same files' fits."""
    return _fit_of_text(json.dumps(result))


@functools.lru_cache(maxsize=4)
def _fit_of_text(text: str) -> Fit:
    return fit_costs(json.loads(text))


def fit_costs(result: dict[str, Any]) -> Fit:
    """The cost model that best explains the file's runs (relative least squares, every
    parameter >= 0), its residuals and the ratios its replays give."""
    specs = _calibrated(list(run_specs(result)))
    fixed = {s: s.replay(_ZERO) for s, _ in specs if s.width != "auto"}  # the same under any
    known = [(s, r) for s, r in specs if s in fixed]  # model
    costs = _started(known, fixed)
    for _ in range(ROUNDS):
        played = {s: fixed.get(s) or s.replay(costs) for s, _ in specs}
        costs = _settled(specs, played, costs)
    played = {s: fixed.get(s) or s.replay(costs) for s, _ in specs}
    residuals = {}
    for spec, run in specs:
        replayed = played[spec]
        for what, measured, steps in _measured(spec, run, replayed):
            residuals[spec.workload, spec.name, what] = (
                measured,
                sum(costs.step(s) for s in steps) / len(steps),
            )
        residuals[spec.workload, spec.name, "job"] = (
            1e3 * run["generation_seconds"],
            1e3 * _seconds(replayed, costs, spec.job),
        )
    speeds = {
        (s.workload, s.name): played[s].tokens / _run_seconds(played[s], costs, r) for s, r in specs
    }
    return Fit(costs, residuals, _ratios(result, speeds))


def _run_seconds(replayed: Replay, costs: FittedCosts, run: dict[str, Any]) -> float:
    """A run's seconds as replayed: its steps (the first aside: the engine counts no period
    for it) and the time the run spent outside its counted steps, as measured (the pipeline's
    start and end jitter by up to 0.1 s: 5% of a 1.8 s run, which no step model predicts)."""
    outside = run["generation_seconds"] - sum(run["step_seconds"].values())
    return sum(costs.step(s) for s, _ in replayed.steps[1:]) / 1e3 + outside


def _seconds(replayed: Replay, costs: FittedCosts, job: Job) -> float:
    """The replayed job's seconds under `costs` (its steps' widths replayed under another)."""
    return sum(costs.step(s) for s, _ in replayed.steps) / 1e3 + costs.job_seconds(job.rows)


Equation = tuple[np.ndarray, float]  # the features of a step or a job, its measured milliseconds


def _equations(
    specs: list[tuple[RunSpec, dict[str, Any]]], played: dict[RunSpec, Replay], costs: FittedCosts
) -> list[Equation]:
    """Per run: its mean step of each kind (and width) timed, and the whole job."""
    out = []
    for spec, run in specs:
        replayed = played[spec]
        for _, measured, steps in _measured(spec, run, replayed):
            features = np.array([costs.features(s) for s in steps])
            out.append((features.mean(axis=0), measured))
        for width, (n, seconds) in (run.get("draft_seconds") or {}).items():
            drafted = [s for s, _ in replayed.steps[1:] if s.drafting and s.width == int(width)]
            if drafted and n and seconds > 0:
                features = np.array([costs.features(s, DRAFT_ROOFLINE) for s in drafted])
                out.append((features.mean(axis=0), 1e3 * seconds / n))
        job = np.sum([costs.features(s) for s, _ in replayed.steps], axis=0)
        job[len(STEP_PARTS) :] = [1e3 * f(spec.job) for f in JOB.values()]
        out.append((job, 1e3 * run["generation_seconds"]))
    return out


def _measured(
    spec: RunSpec, run: dict[str, Any], played: Replay
) -> Iterator[tuple[str, float, list[ReplayStep]]]:
    """(what, measured ms of a mean step, the replay's steps of the same kind [and width]) of
    each kind (and verify width, where recorded) the run's steps were timed in. The replay's
    first step is left out, as the engine counts no period for it."""
    by_kind: dict[str, list[ReplayStep]] = defaultdict(list)
    by_width: dict[tuple[str, int], list[ReplayStep]] = defaultdict(list)
    for step, _ in played.steps[1:]:
        by_kind[step.kind].append(step)
        by_width[step.kind, step.width].append(step)
    widths = run.get("width_seconds") or {}
    for kind, seconds in run["step_seconds"].items():
        if kind == "prefill":  # a period overlapped with the step before: not its own cost
            continue
        count = run["steps"].get(kind, 0)
        if kind in widths:
            for width, (n, width_seconds) in widths[kind].items():
                steps = by_width.get((kind, int(width)))
                if steps and n and width_seconds > 0:
                    yield f"{kind} w{width}", 1e3 * width_seconds / n, steps
        elif by_kind.get(kind) and count and seconds > 0:
            yield kind, 1e3 * seconds / count, by_kind[kind]


def _settled(
    specs: list[tuple[RunSpec, dict[str, Any]]], played: dict[RunSpec, Replay], costs: FittedCosts
) -> FittedCosts:
    """The rooflines' bounds found: each step priced by the side that bounds it under `costs`,
    solved (each equation weighed by its error under `costs`: _weights), and again under the
    solution (BOUND_ROUNDS times); a step near its bound's edge may flip back and forth, so
    the solution that prices the runs best is kept."""
    equations = _equations(specs, played, costs)
    best, best_error = costs, _error(equations, costs)
    for _ in range(BOUND_ROUNDS):
        costs = _solve(equations, _weights(equations, costs))
        equations = _equations(specs, played, costs)
        error = _error(equations, costs)
        if error < best_error:
            best, best_error = costs, error
    return best


def _relative_errors(equations: list[Equation], costs: FittedCosts) -> np.ndarray:
    theta = np.array([getattr(costs, name) for name in PARAMETERS])
    return np.array([float(f @ theta) / ms - 1 for f, ms in equations])


def _weights(equations: list[Equation], costs: FittedCosts) -> np.ndarray:
    """Huber's weights: 1 for an equation within ROBUST of its measurement under `costs`, less
    beyond (its error then counts linearly), so an equation whose replayed steps are not the
    GPU's (an adaptive run whose widths the replay chose otherwise) moves the prices less
    than its square would. Under the zero model every equation weighs 1."""
    errors = np.abs(_relative_errors(equations, costs)) if any(costs.parameters().values()) else 0
    return np.sqrt(np.minimum(1.0, ROBUST / np.maximum(errors, 1e-12)))


def _started(
    specs: list[tuple[RunSpec, dict[str, Any]]], played: dict[RunSpec, Replay]
) -> FittedCosts:
    """The first fit's bounds, settled from the sum of each roofline's sides (every step on
    both) and from that sum with the COMPUTE sides scaled by each of START_SCALES (a step's
    bound moved either way): the best of them, as the bounds' search finds a local best."""
    summed = _solve(_equations(specs, played, _ZERO))
    starts = [summed] + [
        replace(summed, **{n: getattr(summed, n) * k for n in (*COMPUTE, *DRAFT_COMPUTE)})
        for k in START_SCALES
    ]
    fits = [_settled(specs, played, start) for start in starts]
    return min(fits, key=lambda c: _error(_equations(specs, played, c), c))


def _error(equations: list[Equation], costs: FittedCosts) -> float:
    """Huber's loss of the equations' relative errors under `costs` (their features taken
    under `costs` too: each step priced by the side that bounds it): squares within ROBUST,
    linear beyond."""
    errors = np.abs(_relative_errors(equations, costs))
    return float(np.where(errors <= ROBUST, errors**2, 2 * ROBUST * errors - ROBUST**2).sum())


def _solve(equations: list[Equation], weights: np.ndarray | None = None) -> FittedCosts:
    """Non-negative least squares over relative errors (each equation divided by its
    measurement: a 7 ms step's 3% weighs as a 100 ms step's), each times its weight."""
    w = np.ones(len(equations)) if weights is None else weights
    a = np.array([f / ms for f, ms in equations]) * w[:, None]
    theta = nnls(a, w)
    # To 4 digits: another CPU's last bits of a float must not turn a replay's width choice.
    return FittedCosts(
        **{name: float(f"{x:.4g}") for name, x in zip(PARAMETERS, theta, strict=True)}
    )


def nnls(a: np.ndarray, b: np.ndarray, tolerance: float = 1e-12) -> np.ndarray:
    """argmin |a x - b| over x >= 0 (Lawson and Hanson's active set), columns scaled to unit
    norm so that parameters of different units compare."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        free = ~passive & (gradient > tolerance)
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocked = passive & (z <= 0)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            passive &= x > tolerance
    return x / scale


def _ratios(
    result: dict[str, Any], speeds: dict[tuple[str, str], float]
) -> dict[tuple[str, str], tuple[float, float]]:
    """The file's ratios beside the same ratios of the replays (bench/ratios.py)."""
    out = {}
    for wname, entry in result["workloads"].items():
        played = speed_ratios({n: tps for (w, n), tps in speeds.items() if w == wname})
        for key, measured in entry["ratios"].items():
            if key in played:
                out[wname, key] = (measured, played[key])
    return out


_ZERO = FittedCosts(**dict.fromkeys(PARAMETERS, 0.0))
