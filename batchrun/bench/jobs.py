"""`batchrun bench --jobs`: whole jobs as a user runs them, the figure that counts. A random
checkpoint of a real model's shape (and a random DFlash draft for it) is written to a scratch
directory with a tokenizer over its whole vocabulary, each workload is written as Parquet, and
every run goes through `batchrun run`'s own path (job, pipeline, parts committed). Per workload:
no draft; the random draft, which accepts nothing; and the acceptance oracle (bench/oracle.py,
labelled in every figure) at each tau and in each changing-acceptance scenario; each draft run
at the adaptive width and at the full block. Each figure sits beside the job's bound from the
matmul and copy rates measured in the same run, and transformers' generate() on the same prompts
where asked.

One engine per mode (no draft, auto, full) is built for the largest batch and runs every
workload in turn, as a fresh engine would (`Engine.new_job`); each run after an untimed
warm-up of its own rows and oracle, shorter (Triton compiles a kernel variant on its first
use, and a run's widths and chunks are its own)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchrun.attention.kv_dtype import kv_element_size
from batchrun.bench.hooks import BenchHooks, installed
from batchrun.bench.oracle import AcceptanceOracle, check_scenarios
from batchrun.bench.ratios import speed_ratios
from batchrun.bench.roofline import job_bound
from batchrun.bench.scratch_models import write_scratch_models
from batchrun.bench.shapes import DRAFT_LAYERS
from batchrun.bench.workloads import Workload
from batchrun.config.job import JobSpec, load_job
from batchrun.engine.device_rates import measure_ceilings
from batchrun.engine.engine import Engine
from batchrun.engine.heap import collect_everything
from batchrun.engine.step_trace import summarize
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.runners.local import run_job
from batchrun.runners.startup import check_start
from batchrun.spec_decode.registry import METHODS

WARM_TOKENS = 64  # new tokens of a run's warm-up rows
PROFILED_KERNELS = 60  # a profile's kernels kept by name (its table shows the top 25)
EXTRA_KERNELS = 15  # method_costs: the kernels whose time differs most between two runs
ORACLE_LABEL = (
    "benchmark-only acceptance oracle: the draft's forward runs, then its proposals are the "
    "target's own continuation (from this run's no-draft job), each kept right with the "
    "constant chance that gives a full block tau tokens (a scenario's runs: the chance its rule "
    "gives the row at that output position)"
)


@dataclass(frozen=True)
class JobsPlan:
    shape_name: str
    shape: Qwen3Shape
    workloads: tuple[Workload, ...]
    taus: tuple[float, ...]  # oracle runs; () for none
    widths: tuple[str, ...]  # the draft's verify widths to run: auto, full
    scratch: Path
    dtype: str = "bfloat16"
    device: str = "cuda"
    hf_workloads: tuple[str, ...] = ()  # also run generate() on these
    max_batched_tokens: int | None = None  # None: the job default
    prefill_beside_decode: int | None = None  # None: the job default (the rest of the budget)
    default_batch: bool = False  # set no max_batch_size: the job default, as a user who sets none
    profiled: tuple[str, ...] = ()  # profile every run of these (an untimed repeat each)
    kv_cache_dtype: str = "auto"  # the target's KV cache: auto (the model dtype) or fp8
    scenarios: tuple[str, ...] = ()  # oracle runs whose acceptance changes (oracle.SCENARIOS)
    # The speculation methods whose scratch drafts run (spec_decode/registry.py's names): the
    # first's runs are named by width ("full"), another's "<method> <width>".
    draft_methods: tuple[str, ...] = ("dflash",)


def run_jobs(plan: JobsPlan, progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every workload in every mode; `progress` gets the result so far after each run."""
    check_scenarios(plan.scenarios)
    device = torch.device(plan.device)
    dtype = getattr(torch, plan.dtype)
    cuda = device.type == "cuda"
    fp8 = plan.shape.fp8_block is not None
    ceilings = measure_ceilings(dtype, device, fp8=fp8) if cuda else None
    started = time.perf_counter()
    # z-lab's 5-layer draft; a target too shallow for its feature layers (a test's) gets one.
    layers = DRAFT_LAYERS if plan.shape.num_layers >= 2 * DRAFT_LAYERS else 1
    models = partial(
        write_scratch_models, plan.scratch / "models", plan.shape, dtype, device, echo=True
    )
    target, _ = models(draft=False)
    drafts: dict[str, Path | None] = {}
    for method in plan.draft_methods:
        (architecture,) = METHODS[method].architectures
        _, drafts[method] = models(draft_layers=layers, draft_architecture=architecture)
    result: dict[str, Any] = {
        "setup": {
            "shape_name": plan.shape_name,
            "shape": asdict(plan.shape),
            "dtype": plan.dtype,
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "torch": torch.__version__,
            "scratch_models_seconds": time.perf_counter() - started,
            "prefill_beside_decode": plan.prefill_beside_decode,  # the jobs' (None: unset)
        },
        "ceilings": asdict(ceilings) if ceilings is not None else None,
        "oracle": ORACLE_LABEL,
        "startup": {},
        "workloads": {},
    }
    inputs = {w.name: _write_inputs(plan, w) for w in plan.workloads}
    if plan.default_batch:  # every workload at the batch a job gets when none is set
        chosen = {w.name: _default_batch(plan, target, w, inputs) for w in plan.workloads}
        workloads = tuple(replace(w, batch=chosen[w.name]) for w in plan.workloads)
        plan = replace(plan, workloads=workloads)
    row_budgets = {}
    for w in plan.workloads:
        prompts, budgets = w.rows_of(plan.shape.vocab_size, 0)
        row_budgets[w.name] = dict(enumerate(budgets))  # what a scenario's oracle reads
        entry: dict[str, Any] = {"workload": asdict(w), "runs": {}}
        if ceilings is not None:
            lengths = [len(p) for p in prompts]
            kv_element = kv_element_size(plan.kv_cache_dtype, dtype.itemsize)
            entry["bound"] = job_bound(
                plan.shape, dtype.itemsize, lengths, budgets, w.batch, ceilings, kv_element
            )
        result["workloads"][w.name] = entry
    continuations: dict[str, dict[int, list[int]]] = {}  # the no-draft outputs, per workload
    modes = [("none", None)] + [
        (width if i == 0 else f"{method} {width}", drafts[method])
        for i, method in enumerate(plan.draft_methods)
        for width in plan.widths
    ]
    for mode, draft_here in modes:
        runs = _Mode(plan, mode, target, draft_here, inputs, row_budgets, result)
        runs.run_all(continuations, progress)
        del runs
        collect_everything()  # an engine's graphs hold reference cycles: free its KV pools now
        if cuda:
            torch.cuda.empty_cache()
    for w in plan.workloads:
        if w.name in plan.hf_workloads:
            from batchrun.bench.hf_baseline import generate_job

            prompts, budgets = w.rows_of(plan.shape.vocab_size, 0)
            entry = result["workloads"][w.name]
            entry["hf_generate"] = generate_job(target, prompts, budgets, w.batch, dtype, device)
            add_ratios(entry)
            print(f"{w.name} generate(): {entry['hf_generate']}", flush=True)
            progress(result)
    return result


def _write_inputs(plan: JobsPlan, w: Workload) -> tuple[Path, Path]:
    """The workload's Parquet without its json_schema column and with it (the same file
    twice for an unconstrained workload)."""
    folder, vocab = plan.scratch / "inputs", plan.shape.vocab_size
    rows = w.write(folder / f"{w.name}.parquet", vocab, 0)
    free = rows if w.json_schema is None else folder / f"{w.name}-free.parquet"
    return (w.write(free, vocab, 0, constrained=False) if free != rows else rows, rows)


def _warm_input(path: Path) -> Path:
    """The warm-up of a run on `path`: the same rows, each at most WARM_TOKENS new tokens. Its
    waves admit and chunk the prompts as the run's do, so the kernel variants its steps need
    (attention's tiles follow each step's longest chunk) compile here: the first rows alone
    left one to compile inside timed runs (`kernels_compiled` in jobs-h100-w1-j1-useless.json).
    The rows keep their indices, so an oracle drafts for them as for the run."""
    head = path.with_name(f"{path.stem}-warm.parquet")
    if not head.exists():
        table = pq.read_table(path)
        budgets = [WARM_TOKENS] * table.num_rows
        if "max_tokens" in table.column_names:  # a ragged workload's own budgets, capped
            budgets = [min(b, WARM_TOKENS) for b in table.column("max_tokens").to_pylist()]
            table = table.drop(["max_tokens"])
        pq.write_table(table.append_column("max_tokens", pa.array(budgets, pa.int64())), head)
    return head


class _Mode:
    """One engine (no draft, or the draft at one verify width) running every workload: its
    no-draft or useless-draft run and its oracle runs, each after a warm-up."""

    def __init__(
        self,
        plan: JobsPlan,
        mode: str,
        target: Path,
        draft: Path | None,
        inputs: dict[str, tuple[Path, Path]],
        budgets: dict[str, dict[int, int]],
        result: dict[str, Any],
    ) -> None:
        self.plan, self.mode, self.target, self.draft = plan, mode, target, draft
        self.inputs, self.budgets, self.result = inputs, budgets, result
        self.largest = max(w.batch for w in plan.workloads)
        built = time.perf_counter()
        first = _job(plan, target, draft, mode, plan.workloads[0], inputs, mode)
        self.engine = Engine(replace(first.engine_config(), max_batch_size=self.largest))
        result["startup"][mode] = {
            "seconds": time.perf_counter() - built,
            "stages": self.engine.startup_seconds,
        }

    def run_all(
        self,
        continuations: dict[str, dict[int, list[int]]],
        progress: Callable[[dict[str, Any]], None],
    ) -> None:
        for w in self.plan.workloads:
            constrained = w.json_schema is not None
            runs = _runs(self.mode, self.plan.taus, self.plan.scenarios, constrained)
            for name, marks in runs:
                job = _job(self.plan, self.target, self.draft, self.mode, w, self.inputs, name)
                # Each run after a short one of its own (its oracle, its widths): what a first
                # use costs (compiles) is paid there, not in the timed run (on the H100 a first
                # use of width 8 cost ~0.7 s in a 4 s job: jobs-h100-w2-b1-policy-trace.json).
                warm = replace(
                    job,
                    input=replace(job.input, path=str(_warm_input(Path(job.input.path)))),
                    output=replace(job.output, directory=job.output.directory + "-warm"),
                )
                # Each oracle fresh: its seeded draws as the others had them.
                oracle = partial(self._oracle, continuations, w.name, marks)
                _run(self.engine, warm, w.batch, oracle())
                entry = self.result["workloads"][w.name]
                stats = _run(self.engine, job, w.batch, oracle())
                if w.name in self.plan.profiled:  # a repeat, so the timed run pays no profiler
                    entry.setdefault("profiles", {})[name] = _profiled(
                        partial(_run, self.engine, job, w.batch, oracle(), gpu_times=True),
                        self.engine.device,
                    )
                if self.mode == "none":  # a constrained workload's oracle replays "json"
                    continuations[w.name] = outputs(Path(job.output.directory))
                run = _figures(stats, entry.get("bound")) | marks
                entry["runs"][name] = run
                add_ratios(entry)
                add_method_costs(entry, self.plan.draft_methods)
                print(f"{w.name} {name}: {_line(run)}", flush=True)
                progress(self.result)

    def _oracle(
        self,
        continuations: dict[str, dict[int, list[int]]],
        workload: str,
        marks: dict[str, Any],
    ) -> AcceptanceOracle | None:
        """The oracle a run's marks (from _runs) name: at its tau or in its scenario (None: a
        run without one, whose workload may have no continuations yet)."""
        if not marks:
            return None
        continuation, budgets = continuations[workload], self.budgets[workload]
        engine = self.engine
        assert engine.block_size is not None
        return AcceptanceOracle(
            continuation,
            marks.get("designed_tau"),
            engine.block_size,
            self.largest,
            engine.vocab_size,
            engine.device,
            scenario=marks.get("scenario"),
            budgets=budgets,
        )


def _runs(
    mode: str, taus: tuple[float, ...], scenarios: tuple[str, ...], constrained: bool
) -> list[tuple[str, dict[str, Any]]]:
    """(run name, its oracle's marks: {} for none) of an engine mode: the oracle at each tau,
    then in each scenario. A constrained workload's runs are "json ..." (its rows' schemas)
    after an unconstrained "none" of the same rows."""
    if mode == "none":
        return [("none", {}), *([("json", {})] if constrained else [])]
    runs: list[tuple[str, dict[str, Any]]] = [
        (f"useless {mode}", {}),
        *((f"oracle tau {t:g} {mode}", {"oracle": True, "designed_tau": t}) for t in taus),
        *((f"{s} {mode}", {"oracle": True, "scenario": s}) for s in scenarios),
    ]
    return [(f"json {name}" if constrained else name, marks) for name, marks in runs]


def _job(
    plan: JobsPlan,
    target: Path,
    draft: Path | None,
    mode: str,
    w: Workload,
    inputs: dict[str, tuple[Path, Path]],
    name: str,
) -> JobSpec:
    return load_job(
        overrides={
            "input": str(inputs[w.name][1 if name.startswith("json") else 0]),
            "output": str(plan.scratch / "out" / w.name / name.replace(" ", "-")),
            "target": str(target),
            "draft": str(draft) if draft is not None else None,
            "token_ids_column": "prompt_token_ids",
            "max_tokens": w.max_tokens[0] if not w.ragged else None,
            "verify_width": mode.split(" ")[-1] if mode != "none" else None,
            "dtype": plan.dtype,
            "device": plan.device,
            "max_batch_size": None if plan.default_batch else w.batch,
            "max_batched_tokens": plan.max_batched_tokens,
            "prefill_beside_decode": plan.prefill_beside_decode,
            "kv_cache_dtype": plan.kv_cache_dtype,
            "overwrite": True,
            "quiet": True,
        }
    )


def _default_batch(
    plan: JobsPlan, target: Path, w: Workload, inputs: dict[str, tuple[Path, Path]]
) -> int:
    """The batch `batchrun run` chooses for the workload's job without a draft (its start-up
    checks choose it: engine/batch_choice.py)."""
    return check_start(_job(plan, target, None, "none", w, inputs, "none")).found.batch.size


def _run(
    engine: Engine,
    job: JobSpec,
    batch: int,
    oracle: AcceptanceOracle | None,
    gpu_times: bool = False,
) -> dict[str, Any]:
    """The job's statistics, with its steps by kind and width (engine/step_trace.py: with
    gpu_times, each step's GPU time too, which costs CUDA events) and the Triton kernels it
    compiled (a compile inside a timed run is time no later run pays)."""
    engine.new_job(max_batch_size=batch)
    instruments = engine.instruments
    instruments.steps = []
    instruments.timer.reset(enabled=gpu_times)
    compiled = _triton_kernels()
    try:
        with installed(engine.speculator, BenchHooks(oracle=oracle)):
            stats = run_job(job, engine=engine)
    finally:
        timing = instruments.timer.reset(enabled=False)
        records, instruments.steps = instruments.steps or [], None
    trace = summarize(records, timing["draft_ms"], timing["target_ms"])
    new = sorted(name for entry, name in _triton_kernels().items() if entry not in compiled)
    return stats | {"step_trace": trace, "kernels_compiled": new}


def _triton_kernels() -> dict[str, str]:
    """Triton's on-disk cache: entry -> its kernel's name (a compile adds an entry)."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    if not folder.is_dir():
        return {}
    kernels = {}
    for entry in folder.iterdir():
        names = [p.stem for p in entry.glob("*.json") if not p.name.startswith("__grp__")]
        kernels[entry.name] = names[0] if names else "?"
    return kernels


def _profiled(run: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """A whole job under the profiler: its kernels by total time (graph replays included), how
    much of the job the device was busy (the rest is the host or the pipeline's gaps), and its
    steps by kind and width with their GPU times (`run` times them)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        stats = run()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / 1e6
    ranked = sorted(events, key=lambda e: -getattr(e, key))
    return {
        "generation_seconds": stats["generation_seconds"],
        "kernel_seconds": busy,
        "steps": stats["step_trace"],
        "busy_fraction": busy / stats["generation_seconds"],
        # name -> [seconds, calls]: what method_costs compares between two runs
        "kernels": {e.key: [getattr(e, key) / 1e6, e.count] for e in ranked[:PROFILED_KERNELS]},
        "table": events.table(
            sort_by=key.replace("device", "cuda"), row_limit=25, max_name_column_width=70
        ),
    }


def outputs(output: Path) -> dict[int, list[int]]:
    """row_index -> completion token ids of a job's output directory."""
    parts = sorted(output.glob("part-*.parquet"))
    table = pa.concat_tables(
        pq.read_table(p, columns=["row_index", "completion_token_ids"]) for p in parts
    )
    rows = table.to_pydict()
    return dict(zip(rows["row_index"], rows["completion_token_ids"], strict=True))


def _figures(stats: dict[str, Any], bound: dict[str, float] | None) -> dict[str, Any]:
    seconds = stats["generation_seconds"]
    run = {
        "completion_tokens": stats["completion_tokens"],
        "prompt_tokens": stats["prompt_tokens"],
        "generation_seconds": seconds,
        "tokens_per_second": stats["completion_tokens"] / seconds,
        "prompt_tokens_per_second": stats["prompt_tokens"] / seconds,
        "acceptance_length": stats["acceptance_length"],
        "steps": stats["steps"],
        "step_seconds": stats["step_seconds"],
        "width_seconds": stats.get("width_seconds"),  # by kind and width: [steps, seconds]
        "draft_seconds": stats.get("draft_seconds"),  # the draft's own, by width
        "verify_width_steps": stats["verify_width_steps"],
        "step_trace": stats["step_trace"],  # by kind and width: period, longest, replays
        "kernels_compiled": stats["kernels_compiled"],  # Triton kernels compiled inside the run
        "error_rows": stats["error_rows"],
        "max_batch_size": stats["max_batch_size"],  # requests in flight
    }
    if bound is not None:
        run["fraction_of_bound"] = bound["bound_seconds"] / seconds
        run["fraction_of_serial_bound"] = bound["serial_bound_seconds"] / seconds
    return run


def add_ratios(entry: dict[str, Any]) -> None:
    """Each run's tokens/s against its no-draft run and an adaptive width's against the better
    of that and its full block (bench/ratios.py), no draft against generate()."""
    runs = entry["runs"]
    ratios = speed_ratios({name: run["tokens_per_second"] for name, run in runs.items()})
    base = runs.get("none", {}).get("tokens_per_second")
    hf = entry.get("hf_generate", {}).get("tokens_per_second")
    if base and hf:
        ratios["none / generate()"] = base / hf
    entry["ratios"] = ratios


def add_method_costs(entry: dict[str, Any], methods: tuple[str, ...]) -> None:
    """For each run of a method after the first ("<method> <width>"), the share of its step
    that the first method's same run does not spend: with the oracle both commit the same
    tokens in the same steps, so it is what that method's drafter adds to a round (DFlash2's
    convolutions and selector against DFlash)."""
    runs, costs = entry["runs"], {}
    for method in methods[1:]:
        for name, run in runs.items():
            words = name.split(" ")
            if method not in words[:-1]:
                continue
            words.remove(method)
            base = runs.get(" ".join(words))
            steps, base_steps = (
                sum(run["steps"].values()),
                sum((base or {}).get("steps", {}).values()),
            )
            if base is None or not steps or not base_steps:
                continue
            step = run["generation_seconds"] / steps
            base_step = base["generation_seconds"] / base_steps
            cost = costs[f"{name} vs {' '.join(words)}"] = {
                "step_ms": 1e3 * step,
                "base_step_ms": 1e3 * base_step,
                "extra_share_of_round": (step - base_step) / step,
            }
            profiles = entry.get("profiles", {})
            if name in profiles and " ".join(words) in profiles:
                cost["extra_kernels_ms_per_step"] = kernel_difference(
                    profiles[name]["kernels"], profiles[" ".join(words)]["kernels"], steps
                )
    if costs:
        entry["method_costs"] = costs


def kernel_difference(
    kernels: dict[str, list[float]], base: dict[str, list[float]], steps: int
) -> dict[str, float]:
    """Kernel name -> ms per step that one profiled run spends beyond the other (negative: less),
    the largest differences first: where a method's extra share of a round goes."""
    names = set(kernels) | set(base)
    extra = {n: kernels.get(n, [0.0])[0] - base.get(n, [0.0])[0] for n in names}
    ranked = sorted(extra.items(), key=lambda item: -abs(item[1]))[:EXTRA_KERNELS]
    return {n: 1e3 * seconds / steps for n, seconds in ranked}


def _line(run: dict[str, Any]) -> str:
    parts = [f"{run['tokens_per_second']:,.0f} tok/s", f"{run['generation_seconds']:.2f} s"]
    if "fraction_of_bound" in run:
        parts.append(f"{run['fraction_of_bound']:.0%} of bound")
    if run["acceptance_length"] is not None:
        parts.append(f"tau {run['acceptance_length']:.2f}")
    parts.append(json.dumps(run["verify_width_steps"]))
    return ", ".join(parts)
