"""`batchrun bench`: throughput of the engine, target-only and with a draft, against transformers'
generate() measured in the same run on the same prompts, written as JSON. With a shared prefix
(every prompt starting with the same tokens, as a system prompt does) it also runs target-only
without prefix caching, to compare prefill throughput. With n > 1 it also samples n completions
of each prompt, once as rows of n samples (sharing the prompt's K/V) and once as n separate
rows per prompt with the same seeds, to compare their throughput."""

from __future__ import annotations

import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from batchrun.bench.hf_baseline import RUNS, compiled_frames, spread
from batchrun.bench.prompts import workload
from batchrun.bench.steady import profile_point, sync
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request, row_seed, sample_seed
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams


def run_engine(
    engine: Engine, prompts: list[list[int]], max_tokens: int, requests: list[Request] | None = None
) -> dict[str, Any]:
    """Greedy requests of the prompts, or the given `requests`, run to the end."""
    if requests is None:
        params = SamplingParams(max_tokens=max_tokens)
        requests = [Request(i, p, params) for i, p in enumerate(prompts)]
    sync(engine.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for req in requests:
        engine.add(req)
    steps = 0
    finished: list[Request] = []  # with n > 1, more than were added
    while engine.num_unfinished:
        finished += engine.step()
        steps += 1
    sync(engine.device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    finished.sort(key=lambda r: (r.row_index, r.sample_index))
    tokens = sum(len(r.output.token_ids) for r in finished)
    rounds = sum(r.output.spec_rounds for r in finished)
    result: dict[str, Any] = {
        "wall_seconds": wall,
        "cpu_seconds": cpu,  # this process's CPU time: on a shared CPU, steadier than wall
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / wall,
        "prompt_tokens_per_second": sum(len(r.prompt_ids) for r in requests) / wall,
        "steps": steps,
        "outputs": [r.output.token_ids for r in finished],
    }
    if engine.block_size:
        result["acceptance_length"] = (tokens - len(finished)) / rounds if rounds else None
    return result


def sampled_requests(
    prompts: list[list[int]], max_tokens: int, n: int, separate: bool
) -> list[Request]:
    """n samples (temperature 1) of each prompt: rows of n, or n separate rows per prompt,
    row r * n + i, seeded as sample i of row r (the same outputs either way)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, n=n)
    if not separate:
        return [Request(r, p, replace(params, seed=row_seed(0, r))) for r, p in enumerate(prompts)]
    return [
        Request(r * n + i, p, replace(params, n=1, seed=sample_seed(row_seed(0, r), i)))
        for r, p in enumerate(prompts)
        for i in range(n)
    ]


def run_hf_generate(
    target: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """transformers' own batched greedy generate(): the baseline, timed RUNS times."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
    model.to(device).eval()  # type: ignore[arg-type]
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    walls, before = [], compiled_frames()
    for _ in range(RUNS):
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        sync(device)
        walls.append(time.perf_counter() - start)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokens = 0
    for row in out[:, ids.shape[1] :].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        tokens += n
    del model
    wall = spread(walls)
    return {
        "wall_seconds": wall["median"],
        "wall_seconds_runs": wall,
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / wall["median"],
        "compiled": compiled_frames() > before,
    }


def bench(
    config: EngineConfig,
    *,
    num_prompts: int,
    prompt_len: int,
    max_tokens: int,
    hf_baseline: bool,
    shared_prefix: int = 0,
    n: int = 1,
    seed: int = 0,
    profile_batches: tuple[int, ...] = (),
) -> dict[str, Any]:
    target_only = Engine(replace(config, draft=None))
    dtype, device = target_only.model.lm_head.weight.dtype, target_only.device
    vocab, gpu = target_only.vocab_size, device.type == "cuda"
    prompts = workload(vocab, num_prompts, prompt_len, shared_prefix, seed)
    # Each timed run follows a warm-up on other prompts (none of them cached for it): first-call
    # allocations, and on a GPU a workload of the same shape, so that the timed run meets no
    # Triton kernel variant to compile and no graph size for the first time.
    warm = workload(vocab, num_prompts if gpu else 2, prompt_len, shared_prefix, seed + 2)
    warm_tokens = max_tokens if gpu else 4
    run_engine(target_only, warm, warm_tokens)
    results: dict[str, Any] = {"target_only": run_engine(target_only, prompts, max_tokens)}
    profiles = {  # steady decode at a prompt's length of context
        f"target-only batch {b}": profile_point(target_only, b, len(prompts[0]), 6)
        for b in profile_batches
    }
    info = target_only.info()
    del target_only
    if n > 1:  # each a fresh engine: neither run finds the other's prompts cached
        for name, separate in ((f"n_{n}", False), (f"separate_rows_{n}", True)):
            engine = Engine(replace(config, draft=None))
            # Sampled requests: their sampling kernels compile on first use.
            run_engine(engine, warm, warm_tokens, sampled_requests(warm, warm_tokens, n, separate))
            requests = sampled_requests(prompts, max_tokens, n, separate)
            results[name] = run_engine(engine, prompts, max_tokens, requests)
            del engine
    if shared_prefix:
        uncached = Engine(replace(config, draft=None, prefix_caching=False))
        run_engine(uncached, warm, warm_tokens)
        results["no_prefix_cache"] = run_engine(uncached, prompts, max_tokens)
        del uncached
    if config.draft:
        spec = Engine(config)
        run_engine(spec, warm, warm_tokens)
        results["speculative"] = run_engine(spec, prompts, max_tokens)
        info = spec.info()
        del spec
    if hf_baseline:
        results["hf_generate"] = run_hf_generate(
            Path(config.target), prompts, max_tokens, dtype, device
        )
    base = results["target_only"]["output_tokens_per_second"]
    ratios = {
        f"{name}_vs_target_only": r["output_tokens_per_second"] / base
        for name, r in results.items()
        if name != "target_only"
    }
    for name in ("speculative", "no_prefix_cache"):
        if name in results:
            ratios[f"{name}_outputs_identical"] = (
                results[name]["outputs"] == results["target_only"]["outputs"]
            )
    if n > 1:
        grouped, separate = results[f"n_{n}"], results[f"separate_rows_{n}"]
        ratios[f"n_{n}_vs_separate_rows"] = (
            grouped["output_tokens_per_second"] / separate["output_tokens_per_second"]
        )
        ratios[f"n_{n}_vs_separate_rows_by_cpu_seconds"] = (
            separate["cpu_seconds"] / grouped["cpu_seconds"]  # the same tokens either way
        )
        ratios[f"n_{n}_outputs_identical_to_separate_rows"] = (
            grouped["outputs"] == separate["outputs"]
        )
    if "no_prefix_cache" in results:
        ratios["prefix_cache_prefill_speedup"] = (
            results["target_only"]["prompt_tokens_per_second"]
            / results["no_prefix_cache"]["prompt_tokens_per_second"]
        )
    for r in results.values():
        r.pop("outputs", None)
    return {
        "setup": {
            **info,
            "num_prompts": num_prompts,
            "prompt_len": prompt_len,
            "shared_prefix": shared_prefix,
            "n": n,
            "max_tokens": max_tokens,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "results": results,
        "ratios": ratios,
    } | ({"profiles": profiles} if profiles else {})
