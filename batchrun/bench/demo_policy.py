"""`batchrun bench --demo-policy`: the adaptive verify width on the demo pair, run for real on
the machine at hand, on the two jobs where a drafter does not pay: the demo job with a drafter
that accepts nothing (the demo draft's architecture with random weights), and the demo job whose
acceptance collapses half way (its first half greedy, its second at temperature 2, admitted in
input order). Each job runs with no draft, `auto` and `full`; the modes take turns within each
of `repeats` rounds (a drift of the machine falls on all alike), after an untimed round of short
runs (a first run pays for compiling and caches); the median generation rate counts."""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

import batchrun
from batchrun.bench.jobs import add_ratios
from batchrun.config.job import load_job
from batchrun.errors import JobError
from batchrun.runners.local import run_job

MODES = {"none": None, "auto": "auto", "full": "full"}
COLLAPSE_TEMPERATURE = 2.0  # the second half's rows: the draft's greedy guesses rarely match


def demo_job_file() -> Path:
    """jobs/demo.toml of the checkout batchrun runs from (the demo's inputs live beside it)."""
    path = Path(batchrun.__file__).resolve().parent.parent / "jobs" / "demo.toml"
    if not path.is_file():
        raise JobError(f"--demo-policy runs the demo job of a checkout: {path} is missing")
    return path


def write_useless_draft(demo_draft: Path, out: Path, seed: int = 0) -> Path:
    """The demo draft's config with random weights of each matrix's own scale (norms kept):
    the same forward, cost and block, proposals that are almost never the target's."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(demo_draft / "config.json", out / "config.json")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in load_file(str(demo_draft / "model.safetensors")).items():
        if tensor.dim() < 2:
            weights[name] = tensor
            continue
        noise = torch.randn(tensor.shape, generator=generator) * tensor.float().std()
        weights[name] = noise.to(tensor.dtype)
    save_file(weights, str(out / "model.safetensors"))
    return out


def write_collapsing_input(prompts: Path, out: Path) -> Path:
    """The demo prompts, the second half at COLLAPSE_TEMPERATURE (seeded), the first greedy."""
    table = pq.read_table(prompts)
    n = table.num_rows
    temperature = [0.0] * (n // 2) + [COLLAPSE_TEMPERATURE] * (n - n // 2)
    table = table.append_column("temperature", pa.array(temperature, pa.float64()))
    table = table.append_column("seed", pa.array(range(n), pa.int64()))
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out


def run_demo_policy(
    scratch: Path, repeats: int, progress: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    job_file = demo_job_file()
    demo = load_job(job_file)
    draft, prompts = Path(str(demo.value("draft"))), Path(str(demo.value("input")))
    jobs: dict[str, dict[str, Any]] = {
        "useless drafter": {
            "draft": str(write_useless_draft(draft, scratch / "useless-draft")),
        },
        "collapse half way": {
            "input": str(write_collapsing_input(prompts, scratch / "collapse.parquet")),
            "schedule_window": 0,  # input order: the greedy half first
        },
    }
    result: dict[str, Any] = {"jobs": {name: {"runs": {}} for name in jobs}, "repeats": repeats}
    rates: dict[tuple[str, str], list[float]] = {}
    for rep in range(repeats + 1):  # round 0: short, untimed
        for name, overrides in jobs.items():
            for mode, width in MODES.items():
                out = scratch / "out" / name.replace(" ", "-") / f"{mode}-{rep}"
                job = load_job(
                    job_file,
                    overrides={
                        **overrides,
                        "output": str(out),
                        "verify_width": width,
                        "draft": "none" if width is None else overrides.get("draft"),
                        "max_tokens": 32 if rep == 0 else None,
                        "overwrite": True,
                        "quiet": True,
                    },
                )
                stats = run_job(job)
                if rep == 0:
                    continue
                rate = stats["completion_tokens"] / stats["generation_seconds"]
                rates.setdefault((name, mode), []).append(rate)
                entry = result["jobs"][name]["runs"]
                entry[mode] = {
                    "tokens_per_second": statistics.median(rates[name, mode]),
                    "tokens_per_second_runs": rates[name, mode],
                    "acceptance_length": stats["acceptance_length"],
                    "verify_width_steps": stats["verify_width_steps"],
                }
                add_ratios(result["jobs"][name])
                result["jobs"][name]["ratios_by_round"] = _ratios_by_round(rates, name)
                progress(result)
    for name, entry in result["jobs"].items():
        print(name, json.dumps(entry["ratios"]), flush=True)
    return result


def _ratios_by_round(
    rates: dict[tuple[str, str], list[float]], name: str
) -> dict[str, list[float]]:
    """`auto` against no draft and against the better of no draft and `full`, within each
    round: the modes of a round run back to back, so the machine's drift between rounds (a
    few percent on a shared CPU) cancels; the median of these is the figure to hold."""
    none, auto, full = (rates.get((name, m), []) for m in MODES)
    rounds = range(min(len(none), len(auto)))
    best = [max(none[r], full[r]) if r < len(full) else none[r] for r in rounds]
    return {
        "auto / none": [auto[r] / none[r] for r in rounds],
        "auto / best of none and full": [auto[r] / best[r] for r in rounds],
    }
