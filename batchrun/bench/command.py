"""The `batchrun bench` command: end to end on a checkpoint (--target), or the steady-state
sweep at a real model's shape with random weights (--shape)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from batchrun.bench.oracle import FITS, SCENARIOS, check_scenarios
from batchrun.bench.workloads import WORKLOADS, Workload, named_workload


def _ints(text: str) -> tuple[int, ...]:
    """A comma list of positive integers (a bad one is a usage error, in one line)."""
    values = _numbers(text, int)
    if any(v <= 0 for v in values):
        raise click.BadParameter(f"expected positive integers, got {text!r}")
    return tuple(int(v) for v in values)


def _floats(text: str) -> tuple[float, ...]:
    """A comma list of positive finite numbers."""
    values = _numbers(text, float)
    if any(not (0 < v < float("inf")) for v in values):
        raise click.BadParameter(f"expected positive numbers, got {text!r}")
    return tuple(float(v) for v in values)


def _numbers(text: str, kind: type) -> list[float]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected a comma list of numbers, got {text!r}") from None


def _kv_cache_dtypes(text: str) -> tuple[str, ...]:
    """A comma list of KV cache dtypes (auto, fp8)."""
    from batchrun.attention.kv_dtype import KV_CACHE_DTYPES

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in KV_CACHE_DTYPES]
    if bad or not names:
        raise click.BadParameter(f"expected auto, fp8 or a comma list of them, got {text!r}")
    return names


def _scenarios(text: str) -> tuple[str, ...]:
    """A comma list of the oracle's scenarios (oracle.SCENARIOS)."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    try:
        check_scenarios(names)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return names


def _shape_name(name: str | None) -> str | None:
    """A name of bench/shapes.py's SHAPES (imported here: the command's module loads no model
    code until it runs)."""
    from batchrun.bench.shapes import SHAPES

    if name is not None and name not in SHAPES:
        raise click.BadParameter(f"{name!r} is not one of {', '.join(SHAPES)}")
    return name


def _hybrid(name: str) -> bool:
    from batchrun.bench.shapes import SHAPES
    from batchrun.models.families import is_hybrid

    return is_hybrid(SHAPES[name])


def _stats_acceptance(paths: tuple[Path, ...]) -> dict[str, list[float]]:
    """Per-position acceptance (conditional) of finished jobs, named by their files."""
    from batchrun.bench.sweep import conditional_acceptance

    profiles = {}
    for path in paths:
        stats = json.loads(path.read_text())
        if not stats.get("per_position_acceptance"):
            raise click.UsageError(f"{path} holds no per_position_acceptance (a job with a draft)")
        profiles[path.name] = conditional_acceptance(stats["per_position_acceptance"])
    return profiles


@click.command()
@click.option("--target", type=click.Path(path_type=Path), help="Target checkpoint (end to end).")
@click.option("--draft", type=click.Path(path_type=Path), help="DFlash draft (also run).")
@click.option(
    "--shape",
    callback=lambda _ctx, _param, value: _shape_name(value),
    help="Sweep steady-state steps at this shape, random weights on the GPU (no checkpoint): "
    "a name of bench/shapes.py's SHAPES (e.g. qwen3-8b, the hybrid qwen3.5-9b).",
)
# At least 4 layers: the draft reads target layers 1 .. L-3.
@click.option("--num-layers", type=click.IntRange(min=4), help="--shape: override the layer count.")
@click.option(
    "--hidden-size", type=click.IntRange(min=1), help="--shape: override the hidden size."
)
@click.option(
    "--intermediate-size", type=click.IntRange(min=1), help="--shape: override the MLP width."
)
@click.option("--vocab-size", type=click.IntRange(min=1), help="--shape: override the vocabulary.")
@click.option(
    "--fp8-gemm",
    is_flag=True,
    help="--shape: time its projections as block-scaled FP8 matmuls against bf16, per batch.",
)
@click.option(
    "--fp8-weights",
    is_flag=True,
    help="--shape: as the shape's -FP8 checkpoint (128 x 128 block-scaled projections).",
)
@click.option("--batch-sizes", default="1,8,32,128,256", show_default=True, help="--shape sweep.")
@click.option("--contexts", default="512,1024", show_default=True, help="--shape sweep.")
@click.option("--steps", default=16, show_default=True, help="--shape: timed steps per point.")
@click.option(
    "--shared-prefix",
    type=int,
    default=0,
    show_default=True,
    help="--target: tokens every prompt starts with; also runs without prefix caching.",
)
@click.option(
    "--n",
    type=int,
    default=1,
    show_default=True,
    help="--target: also sample n completions per prompt, as rows of n and as n separate rows.",
)
@click.option(
    "--tau",
    default="3,5,6.5",
    show_default=True,
    help="--shape (steady state): the taus to project DFlash at from measured step times. "
    "--jobs: the target tau of the acceptance oracle, which replaces the draft's proposals "
    "so that a full block commits tau tokens on average; the oracle exists only in the "
    "benchmark (batchrun run cannot reach it).",
)
@click.option(
    "--scenarios",
    default="",
    callback=lambda _ctx, _param, value: _scenarios(value),
    help="--jobs: also run the acceptance oracle in these scenarios, where acceptance changes "
    f"over the job: a comma list of {', '.join(SCENARIOS)} (each row's drafts kept right at "
    f"{FITS:g} or 0 by its row and output position; see bench/oracle.py).",
)
@click.option(
    "--acceptance-from",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    help="--shape: also project DFlash at the per-position acceptance of this job's stats.json.",
)
@click.option("--no-draft", is_flag=True, help="--shape: target-only points only.")
@click.option(
    "--penalties",
    is_flag=True,
    help="--shape: time decode steps with and without presence, frequency and repetition "
    "penalties on every row (at the first context), and their ratio.",
)
@click.option(
    "--profile-batches",
    default="",
    help="Batch sizes to profile steady decode at (a kernel table each), e.g. 1,128.",
)
@click.option("--hf-eager/--no-hf-eager", default=True, show_default=True)
@click.option("--hf-compiled-batches", default="32,128", show_default=True)
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True)
@click.option("--num-prompts", default=64, show_default=True, help="--target: prompts.")
@click.option("--prompt-len", default=128, show_default=True, help="--target: prompt tokens.")
@click.option("--max-tokens", default=128, show_default=True, help="--target: new tokens.")
@click.option("--max-batch-size", default=64, show_default=True, help="--target.")
@click.option("--max-batched-tokens", default=4096, show_default=True, help="--target.")
@click.option(
    "--jobs-max-batched-tokens",
    "max_batched_tokens_jobs",
    type=int,
    help="--jobs: the jobs' --max-batched-tokens (default: run's).",
)
@click.option(
    "--jobs-prefill-beside-decode",
    "prefill_beside_decode_jobs",
    type=click.IntRange(min=1),
    help="--jobs: the jobs' --prefill-beside-decode (default: run's, the rest of the budget).",
)
@click.option(
    "--jobs-default-batch",
    "default_batch_jobs",
    is_flag=True,
    help="--jobs: set no --max-batch-size (run's default), as a user who sets none.",
)
@click.option("--dtype", default="auto", show_default=True)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="--target; --shape runs on cuda (cpu only checks the code path, e.g. with --tp).",
)
@click.option(
    "--tp",
    type=int,
    default=1,
    show_default=True,
    help="--shape: tensor parallel size; re-executed under torchrun, one process per GPU, each "
    "building only its share of the target.",
)
@click.option(
    "--attention-backend",
    default="auto",
    show_default=True,
    help="--shape: a comma list sweeps each, side by side (e.g. triton,flashinfer).",
)
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    callback=lambda _ctx, _param, value: _kv_cache_dtypes(value),
    help="--shape: the target's KV cache, auto (the model dtype) or fp8; a comma list sweeps "
    "each, side by side (e.g. auto,fp8). --target, --jobs: one of them.",
)
@click.option(
    "--demo-policy",
    is_flag=True,
    help="The adaptive width on the demo pair, on this machine: a drafter that accepts "
    "nothing, and a job whose acceptance collapses half way, each with no draft, auto and "
    "full (--repeats rounds, modes taking turns); see bench/demo_policy.py.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="--demo-policy: timed rounds (the median counts).",
)
@click.option(
    "--jobs",
    default="",
    help="Whole jobs at --shape's shape (default qwen3-8b): a comma list of workloads "
    f"({', '.join(WORKLOADS)}; NAME@B: at batch B) or all; see bench/jobs.py.",
)
@click.option(
    "--job-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="--jobs: scale every workload's rows and lengths (a small model's test).",
)
@click.option(
    "--widths",
    default="auto,full",
    show_default=True,
    help="--jobs: the draft's verify widths to run.",
)
@click.option(
    "--draft-methods",
    default="dflash",
    show_default=True,
    help="--jobs: the speculation methods whose random drafts run (spec_decode/registry.py's "
    "names, comma-separated: two set the second's drafter against the first's in one call, "
    "each at every width; runs of a method after the first are named "
    "'<method> <width>', and the result's method_costs say what its drafter adds to a round).",
)
@click.option("--hf-jobs", default="", help="--jobs: also run generate() on these workloads.")
@click.option(
    "--profile-jobs",
    default="",
    help="--jobs: profile every run of these workloads (an untimed repeat: its kernels by time).",
)
@click.option(
    "--scratch",
    type=click.Path(path_type=Path),
    help="--jobs, --demo-policy: where the checkpoints and inputs go (kept and reused).",
)
@click.option("--hf-baseline/--no-hf-baseline", default=True, help="--target: time generate().")
@click.option("--out", type=click.Path(path_type=Path), help="Write the result JSON here.")
def bench(out: Path | None, **opts: Any) -> None:
    """Time the engine against baselines measured in the same run."""
    from batchrun.bench.provenance import provenance

    origin = provenance()

    def write(result: dict[str, Any]) -> None:
        """The result so far (each stage's progress too), with where it comes from."""
        result["args"] = ["batchrun", *sys.argv[1:]]
        result["provenance"] = origin
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")

    if len(opts["kv_cache_dtype"]) > 1 and (opts["jobs"] or not opts["shape"]):
        raise click.UsageError(
            "a list of --kv-cache-dtype is for --shape sweeps; --target and --jobs take one"
        )
    if opts["demo_policy"]:
        import tempfile

        from batchrun.bench.demo_policy import run_demo_policy

        scratch = opts["scratch"] or Path(tempfile.gettempdir()) / "batchrun-demo-policy"
        write(run_demo_policy(scratch, opts["repeats"], write))
        return
    if opts["jobs"]:
        if opts["target"] is not None:
            raise click.UsageError("--jobs writes its own random checkpoint: no --target")
        result = _jobs(opts, write)
        write(result)
        ratios = {name: w.get("ratios") for name, w in result["workloads"].items()}
        click.echo(json.dumps(ratios, indent=2))
        return
    if (opts["target"] is None) == (opts["shape"] is None):
        raise click.UsageError("give exactly one of --target and --shape")
    if opts["tp"] > 1 and not opts["shape"]:
        raise click.UsageError("--tp is for --shape (a job runs tensor parallel with run --tp)")
    if opts["tp"] > 1 and _hybrid(opts["shape"]):
        raise click.UsageError("--tp does not run hybrid shapes (nor does run --tp)")
    if opts["tp"] > 1 and "RANK" not in os.environ:
        sys.exit(_relaunch(opts["tp"]))
    if opts["penalties"]:
        if not opts["shape"] or opts["tp"] > 1:
            raise click.UsageError("--penalties needs --shape (and no --tp)")
        result, leads = _penalties(opts), True
    elif opts["fp8_gemm"]:
        if not opts["shape"] or opts["tp"] > 1:
            raise click.UsageError("--fp8-gemm needs --shape (and no --tp)")
        from batchrun.bench.fp8_gemm import sweep_fp8_gemm
        from batchrun.bench.shapes import shape_from_flags

        shape = shape_from_flags(
            opts["shape"],
            hidden_size=opts["hidden_size"],
            intermediate_size=opts["intermediate_size"],
        )
        result, leads = sweep_fp8_gemm(shape, _ints(opts["batch_sizes"])), True
    else:
        result, leads = _sweep(opts, write) if opts["shape"] else (_end_to_end(opts), True)
    if not leads:
        return  # a tensor-parallel rank other than 0: rank 0 reports for the group
    write(result)
    click.echo(json.dumps(result.get("ratios") or result.get("summary"), indent=2))


def _relaunch(tp: int) -> int:
    """This command again, as tp torchrun processes on this host; their exit status."""
    import subprocess

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={tp}",
        "-m",
        "batchrun.cli",
        *sys.argv[1:],
    ]
    return subprocess.call(command)


def _workload(name: str) -> Workload:
    found = named_workload(name)
    assert found is not None, name  # checked by _jobs
    return found


def _jobs(opts: dict[str, Any], progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    import tempfile

    from batchrun.bench.jobs import JobsPlan, run_jobs
    from batchrun.bench.shapes import shape_from_flags

    names = list(WORKLOADS) if opts["jobs"] == "all" else opts["jobs"].split(",")
    unknown = [n for n in names if named_workload(n) is None]
    if unknown:
        raise click.UsageError(
            f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)} "
            "(NAME@B: at batch B)"
        )
    shape = shape_from_flags(
        opts["shape"] or "qwen3-8b",
        num_layers=opts["num_layers"],
        hidden_size=opts["hidden_size"],
        intermediate_size=opts["intermediate_size"],
        vocab_size=opts["vocab_size"],
        fp8_weights=opts["fp8_weights"],
    )
    device = "cuda" if opts["device"] == "auto" else opts["device"]
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError(
                "--jobs at a real shape runs on a CUDA device; none is available"
            )
    dtype = opts["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    plan = JobsPlan(
        shape_name=opts["shape"] or "qwen3-8b",
        shape=shape,
        workloads=tuple(_workload(n).scaled(opts["job_scale"]) for n in names),
        taus=_floats(opts["tau"]),
        scenarios=opts["scenarios"],
        widths=tuple(w for w in opts["widths"].split(",") if w),
        scratch=opts["scratch"] or Path(tempfile.gettempdir()) / "batchrun-bench",
        dtype=dtype,
        device=device,
        hf_workloads=tuple(w for w in opts["hf_jobs"].split(",") if w),
        max_batched_tokens=opts["max_batched_tokens_jobs"],
        prefill_beside_decode=opts["prefill_beside_decode_jobs"],
        default_batch=opts["default_batch_jobs"],
        profiled=tuple(w for w in opts["profile_jobs"].split(",") if w),
        kv_cache_dtype=opts["kv_cache_dtype"][0],
        draft_methods=_draft_methods(opts["draft_methods"]),
    )
    return run_jobs(plan, progress)


def _draft_methods(text: str) -> tuple[str, ...]:
    from batchrun.spec_decode.registry import METHODS

    methods = tuple(m for m in text.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise click.BadParameter(
            f"{text!r}: name one or more of {', '.join(METHODS)}", param_hint="--draft-methods"
        )
    return methods


def _end_to_end(opts: dict[str, Any]) -> dict[str, Any]:
    from batchrun.bench.end_to_end import bench as run_bench
    from batchrun.engine.config import EngineConfig

    config = EngineConfig(
        target=opts["target"],
        draft=opts["draft"],
        dtype=opts["dtype"],
        device=opts["device"],
        attention_backend=opts["attention_backend"],
        kv_cache_dtype=opts["kv_cache_dtype"][0],
        cuda_graphs=opts["cuda_graphs"],
        max_batch_size=opts["max_batch_size"],
        max_batched_tokens=opts["max_batched_tokens"],
    )
    return run_bench(
        config,
        num_prompts=opts["num_prompts"],
        prompt_len=opts["prompt_len"],
        max_tokens=opts["max_tokens"],
        hf_baseline=opts["hf_baseline"],
        shared_prefix=opts["shared_prefix"],
        n=opts["n"],
        profile_batches=_ints(opts["profile_batches"]),
    )


def _penalties(opts: dict[str, Any]) -> dict[str, Any]:
    import torch

    from batchrun.bench.penalties import bench_penalties
    from batchrun.bench.shapes import shape_from_flags

    device = torch.device("cuda" if opts["device"] == "auto" else opts["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--shape runs on a CUDA device; none is available")
    shape = shape_from_flags(
        opts["shape"],
        num_layers=opts["num_layers"],
        hidden_size=opts["hidden_size"],
        intermediate_size=opts["intermediate_size"],
        vocab_size=opts["vocab_size"],
        fp8_weights=opts["fp8_weights"],
    )
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return bench_penalties(
        opts["shape"],
        shape,
        _ints(opts["batch_sizes"]),
        _ints(opts["contexts"])[0],
        opts["steps"],
        dtype.get(opts["dtype"], half),
        device,
        opts["cuda_graphs"],
    )


def _sweep(
    opts: dict[str, Any], progress: Callable[[dict[str, Any]], None]
) -> tuple[dict[str, Any], bool]:
    """The sweep's result, and whether this process reports it (rank 0 of a TP group)."""
    import torch

    from batchrun.bench.shapes import shape_from_flags
    from batchrun.bench.sweep import SweepPlan, run_sweep

    device = torch.device("cuda" if opts["device"] == "auto" else opts["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--shape runs on a CUDA device; none is available")
    tp = None
    if opts["tp"] > 1:
        from batchrun.parallel.group import init_from_env

        tp = init_from_env(os.environ, device.type, opts["tp"])
        device = tp.device
    shape = shape_from_flags(
        opts["shape"],
        num_layers=opts["num_layers"],
        hidden_size=opts["hidden_size"],
        intermediate_size=opts["intermediate_size"],
        vocab_size=opts["vocab_size"],
        fp8_weights=opts["fp8_weights"],
    )
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"auto": half, "bfloat16": torch.bfloat16, "float16": torch.float16}
    plan = SweepPlan(
        shape_name=opts["shape"],
        shape=shape,
        batch_sizes=_ints(opts["batch_sizes"]),
        contexts=_ints(opts["contexts"]),
        steps=opts["steps"],
        taus=_floats(opts["tau"]),
        accept_profiles=_stats_acceptance(opts["acceptance_from"]),
        profile_batches=_ints(opts["profile_batches"]),
        draft=not opts["no_draft"],
        hf_eager=opts["hf_eager"],
        hf_compiled_batches=_ints(opts["hf_compiled_batches"]),
        dtype=dtype.get(opts["dtype"], torch.float32),
        attention_backends=tuple(opts["attention_backend"].split(",")),
        cuda_graphs=opts["cuda_graphs"],
        device=device,
        tp=tp,
        kv_cache_dtypes=opts["kv_cache_dtype"],
    )
    leads = tp is None or tp.rank == 0
    return run_sweep(plan, progress if leads else lambda _: None), leads
