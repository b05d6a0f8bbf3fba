"""`batchrun bench --jobs`: whole jobs as a user runs them, the figure that counts. A random
checkpoint of a real model's shape (and a random DFlash draft for it) is written to a scratch
directory with a tokenizer over its whole vocabulary, each workload is written as Parquet, and
every run goes through `batchrun run`'s own path (job, pipeline, parts committed). Per workload:
no draft; the random draft, which accepts nothing; and the acceptance oracle (bench/oracle.py,
labelled in every figure) at each tau; each draft run at the adaptive width and at the full
block. Each figure sits beside the job's bound from the matmul and copy rates measured in the
same run, and transformers' generate() on the same prompts where asked.

One engine per mode (no draft, auto, full) is built for the largest batch and runs every
workload in turn, as a fresh engine would (`Engine.new_job`), after an untimed warm-up job of
the same shape on other prompts (Triton compiles a kernel variant on its first use)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchrun.bench.oracle import AcceptanceOracle
from batchrun.bench.roofline import job_bound, measure_ceilings
from batchrun.bench.scratch_models import write_scratch_models
from batchrun.bench.shapes import DRAFT_LAYERS
from batchrun.bench.workloads import Workload
from batchrun.engine.engine import Engine
from batchrun.engine.heap import collect_everything
from batchrun.job import JobSpec, load_job
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.pipeline import run_job

ORACLE_LABEL = (
    "benchmark-only acceptance oracle: the draft's forward runs, then its proposals are the "
    "target's own continuation (from this run's no-draft job), each kept right with the "
    "constant chance that gives a full block tau tokens"
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


def run_jobs(plan: JobsPlan, progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    device = torch.device(plan.device)
    dtype = getattr(torch, plan.dtype)
    cuda = device.type == "cuda"
    ceilings = measure_ceilings(dtype, device) if cuda else None
    started = time.perf_counter()
    # z-lab's 5-layer draft; a target too shallow for its feature layers (a test's) gets one.
    layers = DRAFT_LAYERS if plan.shape.num_layers >= 2 * DRAFT_LAYERS else 1
    target, draft = write_scratch_models(
        plan.scratch / "models", plan.shape, dtype, device, draft_layers=layers, echo=True
    )
    result: dict[str, Any] = {
        "setup": {
            "shape_name": plan.shape_name, "shape": asdict(plan.shape), "dtype": plan.dtype,
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "torch": torch.__version__, "scratch_models_seconds": time.perf_counter() - started,
        },
        "ceilings": asdict(ceilings) if ceilings is not None else None,
        "oracle": ORACLE_LABEL,
        "startup": {},
        "workloads": {},
    }  # fmt: skip
    inputs: dict[str, tuple[Path, Path]] = {}
    for w in plan.workloads:
        timed = w.write(plan.scratch / "inputs" / f"{w.name}.parquet", plan.shape.vocab_size, 0)
        warm = replace(w, rows=min(w.rows, w.batch), max_tokens=_capped(w.max_tokens, 32))
        warm_path = warm.write(plan.scratch / "inputs" / f"{w.name}-warm.parquet",
                               plan.shape.vocab_size, 1)  # fmt: skip
        prompts, budgets = w.rows_of(plan.shape.vocab_size, 0)
        entry: dict[str, Any] = {"workload": asdict(w), "runs": {}}
        if ceilings is not None:
            element = dtype.itemsize
            entry["bound"] = job_bound(plan.shape, element, [len(p) for p in prompts], budgets,
                                       w.batch, ceilings)  # fmt: skip
        result["workloads"][w.name] = entry
        inputs[w.name] = (timed, warm_path)
    continuations: dict[str, dict[int, list[int]]] = {}
    largest = max(w.batch for w in plan.workloads)
    for mode in ("none", *plan.widths):
        engine: Engine | None = None
        for w in plan.workloads:
            for name, tau in _runs(mode, plan.taus):
                job = _job(plan, target, draft if mode != "none" else None, mode, w, inputs, name)
                if engine is None:
                    built = time.perf_counter()
                    engine = Engine(replace(job.engine_config(), max_batch_size=largest))
                    result["startup"][mode] = {
                        "seconds": time.perf_counter() - built,
                        "stages": engine.startup_seconds,
                    }
                if name == _runs(mode, plan.taus)[0][0]:  # the workload's first run: warm up
                    _run(engine, replace(job, input=str(inputs[w.name][1]),
                                         output=job.output + "-warm"), w.batch, None)  # fmt: skip
                oracle = None
                if tau is not None:
                    assert engine.block_size is not None
                    oracle = AcceptanceOracle(
                        continuations[w.name], tau, engine.block_size, largest,
                        engine.vocab_size, engine.device,
                    )  # fmt: skip
                stats = _run(engine, job, w.batch, oracle)
                if mode == "none":
                    continuations[w.name] = outputs(Path(job.output))
                run = _figures(stats, result["workloads"][w.name].get("bound"))
                if tau is not None:
                    run |= {"oracle": True, "designed_tau": tau}
                result["workloads"][w.name]["runs"][name] = run
                _ratios(result["workloads"][w.name])
                print(f"{w.name} {name}: {_line(run)}", flush=True)
                progress(result)
        del engine
        collect_everything()  # its graphs hold reference cycles: free its KV pools now
        if cuda:
            torch.cuda.empty_cache()
    for w in plan.workloads:
        if w.name in plan.hf_workloads:
            from batchrun.bench.hf_baseline import generate_job

            prompts, budgets = w.rows_of(plan.shape.vocab_size, 0)
            entry = result["workloads"][w.name]
            entry["hf_generate"] = generate_job(target, prompts, budgets, w.batch, dtype, device)
            _ratios(entry)
            print(f"{w.name} generate(): {entry['hf_generate']}", flush=True)
            progress(result)
    return result


def _capped(span: tuple[int, int], most: int) -> tuple[int, int]:
    return (min(span[0], most), min(span[1], most))


def _runs(mode: str, taus: tuple[float, ...]) -> list[tuple[str, float | None]]:
    """(run name, oracle tau or None) of an engine mode."""
    if mode == "none":
        return [("none", None)]
    return [(f"useless {mode}", None)] + [(f"oracle tau {t:g} {mode}", t) for t in taus]


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
            "input": str(inputs[w.name][0]),
            "output": str(plan.scratch / "out" / w.name / name.replace(" ", "-")),
            "target": str(target),
            "draft": str(draft) if draft is not None else None,
            "token_ids_column": "prompt_token_ids",
            "max_tokens": w.max_tokens[0] if not w.ragged else None,
            "verify_width": mode if mode != "none" else None,
            "dtype": plan.dtype,
            "device": plan.device,
            "max_batch_size": w.batch,
            "max_batched_tokens": plan.max_batched_tokens,
            "overwrite": True,
            "quiet": True,
        }
    )


def _run(
    engine: Engine, job: JobSpec, batch: int, oracle: AcceptanceOracle | None
) -> dict[str, Any]:
    engine.new_job(max_batch_size=batch)
    engine.draft_oracle = oracle
    try:
        return run_job(job, engine=engine)
    finally:
        engine.draft_oracle = None


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
        "verify_width_steps": stats["verify_width_steps"],
        "error_rows": stats["error_rows"],
    }
    if bound is not None:
        run["fraction_of_bound"] = bound["bound_seconds"] / seconds
    return run


def _ratios(entry: dict[str, Any]) -> None:
    """Each run's tokens/s against no draft, a draft's adaptive width against the better of no
    draft and the full block, no draft against generate()."""
    runs = entry["runs"]
    base = runs.get("none", {}).get("tokens_per_second")
    ratios: dict[str, float] = {}
    for name, run in runs.items():
        if base and name != "none":
            ratios[f"{name} / none"] = run["tokens_per_second"] / base
        full = runs.get(name.replace(" auto", " full"))
        if base and name.endswith(" auto") and full:
            best = max(base, full["tokens_per_second"])
            ratios[f"{name} / best of none and full"] = run["tokens_per_second"] / best
    hf = entry.get("hf_generate", {}).get("tokens_per_second")
    if base and hf:
        ratios["none / generate()"] = base / hf
    entry["ratios"] = ratios


def _line(run: dict[str, Any]) -> str:
    parts = [f"{run['tokens_per_second']:,.0f} tok/s", f"{run['generation_seconds']:.2f} s"]
    if "fraction_of_bound" in run:
        parts.append(f"{run['fraction_of_bound']:.0%} of bound")
    if run["acceptance_length"] is not None:
        parts.append(f"tau {run['acceptance_length']:.2f}")
    parts.append(json.dumps(run["verify_width_steps"]))
    return ", ".join(parts)
