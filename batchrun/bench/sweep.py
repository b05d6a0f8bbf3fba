"""The steady-state sweep of `batchrun bench --shape`: for each batch size and context length,
the engine's milliseconds per decode step (target-only) and per DFlash round (draft + verify) at
every verify width, split into draft, target and host time, against the memory roofline and
transformers' generate() on the same prompts, all measured in one run.

Random weights accept no draft, so DFlash throughput is projected: a round of width w commits
expected_tokens(accept, w) tokens per request at a per-position acceptance profile (geometric
ones at the given tau values, and optionally a real job's, from its stats.json), over the
round's measured time. Full width is the block; adaptive is the width the engine's policy
would pick from these costs (spec_decode/width_policy.py).

Each KV cache dtype asked for (auto, fp8) sweeps every backend with an engine of its own; an fp8
run's points are labelled `<backend>-fp8kv` beside the backend's own (step_ms_by_backend), and
its roofline reads one byte per K/V element."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from batchrun.attention.kv_dtype import kv_element_size
from batchrun.bench.hf_baseline import decode_ms_per_step
from batchrun.bench.hooks import BenchHooks, installed
from batchrun.bench.prompts import random_prompts
from batchrun.bench.roofline import step_floor_ms
from batchrun.bench.shapes import DRAFT_BLOCK, hf_twin, random_draft, random_target
from batchrun.bench.steady import profile_point, start_decoding, sync, timed_rollbacks
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.device_rates import Ceilings, measure_ceilings
from batchrun.engine.engine import Engine
from batchrun.engine.heap import collect_everything
from batchrun.engine.startup import Models
from batchrun.errors import JobError
from batchrun.models.families import is_hybrid
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.width_policy import best_width, expected_tokens


@dataclass(frozen=True)
class SweepPlan:
    shape_name: str
    shape: Qwen3Shape
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: int  # timed steps per point
    taus: tuple[float, ...]  # acceptance lengths to project DFlash throughput at
    accept_profiles: dict[str, list[float]]  # more per-position acceptance profiles, by name
    profile_batches: tuple[int, ...]  # batch sizes to profile (kernel table per mode)
    draft: bool
    hf_eager: bool
    hf_compiled_batches: tuple[int, ...]  # batch sizes to run compiled generate() at
    dtype: torch.dtype
    attention_backends: tuple[str, ...]  # each sweeps every point; the first is summarized
    cuda_graphs: bool
    device: torch.device = torch.device("cuda")  # a CPU sweep only checks the code path
    tp: TensorParallel | None = None  # a tensor-parallel rank: its share of the target
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # each sweeps every backend


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def measure_point(engine: Engine, batch: int, context: int, steps: int) -> list[dict[str, Any]]:
    """Time `steps` steps of `batch` requests decoding at about `context` tokens of context, at
    each of the engine's verify widths, each from a fresh prefill: every width (and the
    target-only engine) is timed at the same context, which grows as steps commit."""
    points = []
    speculator = engine.speculator
    for width in sorted(speculator.widths, reverse=True):
        with installed(speculator, BenchHooks(pinned_width=width)):
            reqs = start_decoding(engine, batch, context)
            point = {"batch": batch, "context": context, "width": width}
            points.append(point | time_steps(engine, reqs, steps))
            engine.abort_all()
    return points


def time_steps(engine: Engine, reqs: list[Request], steps: int) -> dict[str, Any]:
    engine.instruments.timer.reset(enabled=True)
    graphed = engine.runner.replays.total()
    before = sum(len(r.output.token_ids) for r in reqs)
    sync(engine.device)
    with timed_rollbacks(engine) as rollbacks:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    committed = sum(len(r.output.token_ids) for r in reqs) - before
    timing = engine.instruments.timer.reset(enabled=False)
    draft_ms, target_ms = _median(timing["draft_ms"]), _median(timing["target_ms"])
    return {
        "ms_per_step": wall_ms,
        "draft_ms": draft_ms,
        "target_ms": target_ms,
        "host_ms": max(0.0, wall_ms - draft_ms - target_ms),
        "tokens_per_second": committed / steps / wall_ms * 1e3,
        "graphed_forwards_per_step": (engine.runner.replays.total() - graphed) / steps,
    } | ({"rollback_ms": _median(rollbacks)} if rollbacks else {})


def run_sweep(
    plan: SweepPlan, progress: Callable[[dict[str, Any]], None] = lambda result: None
) -> dict[str, Any]:
    """The whole sweep; `progress` gets the result so far after each stage (so a run cut short
    by a time limit still leaves its figures). Under tensor parallelism every rank runs it in
    step (the engine's collectives), each with its own share of the target; the roofline is
    a rank's (the weights its GPU reads) and there is no generate() baseline (no rank holds the
    whole model)."""
    device = plan.device
    fp8 = plan.shape.fp8_block is not None
    ceilings = measure_ceilings(plan.dtype, device, fp8=fp8) if device.type == "cuda" else None
    model = random_target(plan.shape, plan.dtype, device, plan.tp)
    max_batch = max(plan.batch_sizes)
    max_len = max(plan.contexts) + 4 * plan.steps + 64
    max_positions = plan.shape.max_position_embeddings + 1024
    draft = random_draft(model, plan.shape, max_positions) if plan.draft else None
    # The weights a rank's GPU reads per step: its heads and MLP rows, its vocabulary slice.
    floor_shape = replace(model.shape, vocab_size=model.lm_head.weight.shape[0])
    width = draft.block_size if draft is not None else 1
    points: list[dict[str, Any]] = []
    profiles: dict[str, str] = {}
    element = model.lm_head.weight.element_size()
    for kv, backend in [(kv, b) for kv in plan.kv_cache_dtypes for b in plan.attention_backends]:
        config = EngineConfig(
            target=Path(f"random-{plan.shape_name}"),
            device=str(device),
            dtype=str(plan.dtype).removeprefix("torch."),
            attention_backend=backend,
            kv_cache_dtype=kv,
            cuda_graphs=plan.cuda_graphs,
            max_batch_size=max_batch,
            max_batched_tokens=max(8192, max_batch * width),
            max_model_len=max_len,
            verify_width="auto",
        )
        kv_element = kv_element_size(kv, element)
        for with_draft in [False, True] if draft is not None else [False]:
            models = Models(model, draft if with_draft else None)
            pages = _pages(config, max_len, width)
            try:
                engine = Engine(config, tp=plan.tp, models=models, num_pages=pages)
            except JobError as exc:  # a backend that reads no such cache (flashinfer, fp8)
                print(f"skipped {backend} with kv_cache_dtype {kv}: {exc}", flush=True)
                break
            mode = "dflash" if with_draft else "target_only"
            used = engine.info()["attention_backend"]  # what `auto` resolved to
            for batch in plan.batch_sizes:
                for context in plan.contexts:
                    for point in measure_point(engine, batch, context, plan.steps):
                        point |= {"mode": mode, "attention_backend": used, "kv_cache_dtype": kv}
                        if not with_draft and ceilings is not None:
                            floor = step_floor_ms(
                                floor_shape, element, batch, context, 1, ceilings, kv_element
                            )
                            point["roofline"] = floor
                            point["fraction_of_memory_roofline"] = (
                                floor["memory_ms"] / point["ms_per_step"]
                            )
                        points.append(point)
                        print(_row(point), flush=True)
            for batch in plan.profile_batches:
                name = f"{_label(used, kv)} {mode} batch {batch}"
                profiles[name] = profile_point(engine, batch, plan.contexts[0], 4)
            del engine
            collect_everything()  # its graphs hold reference cycles: free its KV pools now
            if device.type == "cuda":
                torch.cuda.empty_cache()
    baselines: list[dict[str, Any]] = []
    result = _result(plan, ceilings, points, baselines, profiles)
    progress(result)
    # generate() runs on a transformers twin of a dense Qwen3 (none for a MoE or hybrid shape:
    # transformers runs the hybrids' Gated DeltaNet on its torch fallback without the
    # flash-linear-attention kernels, no baseline worth timing against).
    dense = not model.shape.num_experts and not is_hybrid(model.shape)
    if plan.tp is None and dense and (plan.hf_eager or plan.hf_compiled_batches):
        hf = hf_twin(model)
        for baseline in _hf_baselines(plan, hf):
            baselines.append(baseline)
            result = _result(plan, ceilings, points, baselines, profiles)
            progress(result)
    return result


def _result(
    plan: SweepPlan,
    ceilings: Ceilings | None,
    points: list[dict[str, Any]],
    baselines: list[dict[str, Any]],
    profiles: dict[str, str],
) -> dict[str, Any]:
    device = plan.device
    accept = acceptance_profiles(plan)
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        by_backend.setdefault(_point_label(p), []).append(p)
    first = next(iter(by_backend.values()), [])
    return {
        "setup": {
            "shape_name": plan.shape_name,
            "shape": asdict(plan.shape),
            "dtype": str(plan.dtype),
            "attention_backends": list(plan.attention_backends),
            "kv_cache_dtypes": list(plan.kv_cache_dtypes),
            "cuda_graphs": plan.cuda_graphs,
            "steps": plan.steps,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "tensor_parallel": plan.tp.world_size if plan.tp is not None else 1,
            "torch": torch.__version__,
        },
        "ceilings": asdict(ceilings) if ceilings is not None else None,
        "points": points,
        "hf_generate": baselines,
        "acceptance_profiles": accept,
        "summary": summarize(first, baselines, accept),
        "summary_by_backend": {
            name: summarize(ps, baselines, accept) for name, ps in by_backend.items()
        },
        "step_ms_by_backend": side_by_side(points),
        "profiles": profiles,
    }


def _pages(config: EngineConfig, max_len: int, width: int) -> int:
    per_request = -(-(max_len + width) // config.page_size) + 1
    return config.batch_size * per_request


def _hf_baselines(plan: SweepPlan, hf: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """generate() at every batch size, at the first context (eager, then compiled)."""
    vocab = plan.shape.vocab_size
    for batch in plan.batch_sizes:
        for context in plan.contexts[:1]:
            ids = torch.tensor(random_prompts(vocab, batch, context), device="cuda")
            modes = (["eager"] if plan.hf_eager else []) + (
                ["static_compiled"] if batch in plan.hf_compiled_batches else []
            )
            for mode in modes:
                steps = min(plan.steps, 16)
                result = decode_ms_per_step(hf, ids, steps, static_cache=mode != "eager")
                print(f"generate() {mode:>15} batch {batch:>4} context {context:>5}: {result}")
                yield {"batch": batch, "context": context, "mode": mode, **result}


def geometric_acceptance(tau: float, block_size: int) -> list[float]:
    """The constant per-position acceptance p at which a full block commits tau tokens on
    average (bisection on expected_tokens, which grows with p)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens([mid] * (block_size - 1), block_size) < tau:
            lo = mid
        else:
            hi = mid
    return [lo] * (block_size - 1)


def conditional_acceptance(per_position: list[float]) -> list[float]:
    """stats.json's per_position_acceptance (the share of rounds accepting draft j) as the
    chance of accepting draft j once 1 .. j-1 were."""
    out, before = [], 1.0
    for share in per_position:
        out.append(share / before if before > 0 else 0.0)
        before = share
    return out


def acceptance_profiles(plan: SweepPlan) -> dict[str, list[float]]:
    profiles = {f"tau {t:g}": geometric_acceptance(t, DRAFT_BLOCK) for t in plan.taus}
    return profiles | plan.accept_profiles


def summarize(
    points: list[dict[str, Any]],
    baselines: list[dict[str, Any]],
    profiles: dict[str, list[float]],
) -> list[dict[str, Any]]:
    """Per (batch, context): the ratios the issue's targets are stated in."""
    rows = []
    plain = {(p["batch"], p["context"]): p for p in points if p["mode"] == "target_only"}
    rounds: dict[tuple[int, int], dict[int, float]] = {}
    rollbacks: dict[tuple[int, int], dict[int, float]] = {}  # a hybrid's, as a share of a round
    for p in points:
        if p["mode"] == "dflash":
            key = (p["batch"], p["context"])
            rounds.setdefault(key, {})[p["width"]] = p["ms_per_step"]
            if "rollback_ms" in p:
                rollbacks.setdefault(key, {})[p["width"]] = p["rollback_ms"] / p["ms_per_step"]
    for key, p in sorted(plain.items()):
        row: dict[str, Any] = {
            "batch": key[0],
            "context": key[1],
            "target_only_ms_per_token_step": p["ms_per_step"],
            "target_only_tokens_per_second": p["tokens_per_second"],
            "fraction_of_memory_roofline": p.get("fraction_of_memory_roofline"),
        }
        if key in rounds:
            costs = rounds[key]
            row["dflash_round_ms_by_width"] = costs
            row["dflash"] = {
                name: _projection(key[0], accept, costs, p["tokens_per_second"])
                for name, accept in profiles.items()
            }
        if key in rollbacks:
            row["rollback_share_by_width"] = rollbacks[key]
        for b in baselines:
            if (b["batch"], b["context"]) == key and "tokens_per_second" in b:
                row[f"vs_generate_{b['mode']}"] = p["tokens_per_second"] / b["tokens_per_second"]
        rows.append(row)
    return rows


def side_by_side(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Milliseconds per step of each attention backend at each (mode, batch, context, width)."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in points:
        key = (p["mode"], p["batch"], p["context"], p["width"])
        names = ("mode", "batch", "context", "width")
        row = rows.setdefault(key, dict(zip(names, key, strict=True)))
        row[f"{_point_label(p)}_ms"] = p["ms_per_step"]
    return list(rows.values())


def _projection(
    batch: int, accept: list[float], costs: dict[int, float], target_only: float
) -> dict[str, Any]:
    """Full-width and adaptive DFlash tokens/s at one acceptance profile, and their ratios."""

    def tokens_per_second(width: int) -> float:
        return batch * expected_tokens(accept, width) / costs[width] * 1e3

    full, chosen = max(costs), best_width(accept, costs)
    return {
        "full_width_tokens_per_second": tokens_per_second(full),
        "adaptive_tokens_per_second": tokens_per_second(chosen),
        "adaptive_width": chosen,
        "full_width_vs_target_only": tokens_per_second(full) / target_only,
        "adaptive_vs_target_only": tokens_per_second(chosen) / target_only,
        "adaptive_vs_full_width": tokens_per_second(chosen) / tokens_per_second(full),
    }


def _label(backend: str, kv_cache_dtype: str) -> str:
    """A backend's name, with `-fp8kv` over an fp8 KV cache."""
    return backend if kv_cache_dtype == "auto" else f"{backend}-{kv_cache_dtype}kv"


def _point_label(p: dict[str, Any]) -> str:
    return _label(p["attention_backend"], p.get("kv_cache_dtype", "auto"))


def _row(p: dict[str, Any]) -> str:
    return (
        f"{_point_label(p):>10} {p['mode']:>11} width {p['width']:>2} "
        f"batch {p['batch']:>4} context {p['context']:>5}: "
        f"{p['ms_per_step']:7.2f} ms/step (draft {p['draft_ms']:.2f}, target "
        f"{p['target_ms']:.2f}, host {p['host_ms']:.2f}), {p['tokens_per_second']:9.1f} tok/s"
    )
