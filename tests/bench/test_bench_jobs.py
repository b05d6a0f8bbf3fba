"""`batchrun bench --jobs` on the CPU at a tiny shape: whole jobs through run's own path, one
engine per mode running every workload, the oracle's acceptance labelled and lossless."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from batchrun.bench.jobs import WARM_TOKENS, JobsPlan, kernel_difference, outputs, run_jobs
from batchrun.bench.workloads import WORKLOADS
from batchrun.models.qwen3 import Qwen3Shape

pytestmark = pytest.mark.usefixtures("one_thread_module")
TINY = Qwen3Shape(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def test_jobs_run_every_mode_and_agree(tmp_path: Path) -> None:
    plan = JobsPlan(
        shape_name="tiny",
        shape=TINY,
        workloads=(WORKLOADS["w2"].scaled(0.1), WORKLOADS["w3"].scaled(0.02)),
        taus=(6.5,),
        widths=("auto", "full"),
        scratch=tmp_path,
        dtype="float32",
        device="cpu",
        profiled=("w2",),
        prefill_beside_decode=8,  # the jobs' engine option, recorded (stall-free chunks)
    )
    seen: list[dict] = []
    result = run_jobs(plan, seen.append)
    assert result["setup"]["prefill_beside_decode"] == 8
    assert seen and seen[-1] is result  # the figures so far after each run
    assert "oracle" in result["oracle"]
    for mode in ("none", "auto", "full"):
        assert result["startup"][mode]["stages"]["load_target"] >= 0
    profiles = result["workloads"]["w2"]["profiles"]  # every run's, an untimed repeat each
    assert set(profiles) == set(result["workloads"]["w2"]["runs"])
    for name, profile in profiles.items():
        assert profile["kernel_seconds"] > 0 and "aten::" in profile["table"]
        # its steps by kind and width: the timed run's (the same job again), but for the one
        # launched before the last request finished, never read
        steps = result["workloads"]["w2"]["runs"][name]["steps"]
        traced = sum(s["steps"] for s in profile["steps"].values())
        assert sum(steps.values()) - traced in (0, 1)
        assert {key.split(" ")[0] for key in profile["steps"]} == set(steps)
        assert all(seconds >= 0 and calls > 0 for seconds, calls in profile["kernels"].values())
    assert "profiles" not in result["workloads"]["w3"]
    for name, entry in result["workloads"].items():
        runs = entry["runs"]
        assert set(runs) == {
            "none",
            "useless auto",
            "oracle tau 6.5 auto",
            "useless full",
            "oracle tau 6.5 full",
        }
        rows = entry["workload"]["rows"]
        for run in runs.values():
            assert run["error_rows"] == 0 and run["completion_tokens"] > rows
            assert sum(run["steps"].values()) > 0
            assert set(run["step_seconds"]) == set(run["steps"])  # where the time went
            assert 0 < sum(run["step_seconds"].values()) <= run["generation_seconds"]
            for kind, widths in run["width_seconds"].items():  # the same by width: a fit's input
                # (steps read back: one launched as a job ends may be dropped unread)
                assert 0 < sum(n for n, _ in widths.values()) <= run["steps"][kind]
                assert sum(t for _, t in widths.values()) == pytest.approx(
                    run["step_seconds"][kind], abs=1e-3
                )
            for key, traced in run["step_trace"].items():  # the same steps, one at a time
                kind, width = key.split(" ")
                assert traced["steps"] == run["width_seconds"][kind][width][0]
                assert traced["max_period_ms"] >= traced["period_ms"] > 0 or kind == "prefill"
            assert run["kernels_compiled"] == []  # no GPU: Triton compiles nothing
        # Each run after a short run of its own rows
        for run in runs:
            warm = outputs(tmp_path / "out" / name / (run.replace(" ", "-") + "-warm"))
            assert set(warm) == set(range(rows))
            assert all(0 < len(tokens) <= WARM_TOKENS for tokens in warm.values())
        for run in (runs["useless full"], runs["oracle tau 6.5 full"]):  # the draft, timed
            assert set(run["draft_seconds"]) == {"16"} and run["draft_seconds"]["16"][1] > 0
        assert runs["none"]["draft_seconds"] is None
        oracle = runs["oracle tau 6.5 full"]
        assert oracle["oracle"] and oracle["designed_tau"] == 6.5
        assert oracle["acceptance_length"] > 3, name  # the oracle reached the verify
        assert runs["useless full"]["acceptance_length"] < 1.5
        assert "oracle tau 6.5 auto / best of none and full" in entry["ratios"]
        # Lossless: every mode wrote the same completions (float32).
        written = {run: outputs(tmp_path / "out" / name / run.replace(" ", "-")) for run in runs}
        assert all(o == written["none"] for o in written.values()), name


def test_a_second_draft_method_runs_beside_the_first(tmp_path: Path) -> None:
    """--draft-methods dflash,dflash2: DFlash2's scratch drafter (z-lab's layout at the shape)
    runs each width beside DFlash's in one call, lossless, its cost over DFlash's per round in
    method_costs."""
    plan = JobsPlan(
        shape_name="tiny",
        shape=TINY,
        workloads=(WORKLOADS["w2"].scaled(0.1),),
        taus=(6.5,),
        widths=("full",),
        scratch=tmp_path,
        dtype="float32",
        device="cpu",
        draft_methods=("dflash", "dflash2"),
        profiled=("w2",),
    )
    entry = run_jobs(plan, lambda _: None)["workloads"]["w2"]
    runs = entry["runs"]
    assert set(runs) == {
        "none",
        "useless full",
        "oracle tau 6.5 full",
        "useless dflash2 full",
        "oracle tau 6.5 dflash2 full",
    }
    assert runs["oracle tau 6.5 dflash2 full"]["acceptance_length"] > 3
    written = {run: outputs(tmp_path / "out" / "w2" / run.replace(" ", "-")) for run in runs}
    assert all(o == written["none"] for o in written.values())
    cost = entry["method_costs"]["oracle tau 6.5 dflash2 full vs oracle tau 6.5 full"]
    assert cost["step_ms"] > 0 and cost["base_step_ms"] > 0 and cost["extra_share_of_round"] < 1
    # where the extra time goes: the selector's top-K is DFlash2's alone (DFlash takes argmax)
    extra = cost["extra_kernels_ms_per_step"]
    assert (
        extra["aten::topk"] > 0
        and "aten::topk" not in entry["profiles"]["oracle tau 6.5 full"]["kernels"]
    )
    config = (tmp_path / "models" / "draft-DFlash2DraftModel" / "config.json").read_text()
    assert '"selector_top_k": 16' in config


def testkernel_difference_ranks_what_one_run_spends_beyond_the_other() -> None:
    kernels = {"topk": [0.3, 10], "gemm": [1.0, 10], "conv": [0.2, 40]}
    base = {"gemm": [1.1, 10], "argmax": [0.05, 10]}
    extra = kernel_difference(kernels, base, steps=10)
    assert list(extra) == ["topk", "conv", "gemm", "argmax"]  # by size of the difference
    assert extra["topk"] == pytest.approx(30.0) and extra["gemm"] == pytest.approx(-10.0)
    assert extra["argmax"] == pytest.approx(-5.0)


def test_a_json_schema_workload_runs_constrained_beside_unconstrained(tmp_path: Path) -> None:
    plan = JobsPlan(
        shape_name="tiny",
        shape=TINY,
        workloads=(WORKLOADS["j1"].scaled(0.1),),
        taus=(6.5,),
        # The full block, not auto: auto's widths follow the step times this machine measures,
        # and a loaded CPU makes it verify narrower (fewer tokens a round) than an idle one.
        widths=("full",),
        scratch=tmp_path,
        dtype="float32",
        device="cpu",
    )
    entry = run_jobs(plan, lambda _: None)["workloads"]["j1"]
    runs = entry["runs"]
    assert set(runs) == {"none", "json", "json useless full", "json oracle tau 6.5 full"}
    assert "json / none" in entry["ratios"]
    assert runs["json oracle tau 6.5 full"]["acceptance_length"] > 3  # drafts the grammar allows
    completions = {
        run: pl.read_parquet(tmp_path / "out" / "j1" / run.replace(" ", "-") / "*.parquet")
        .sort("row_index")["completion"]
        .to_list()
        for run in runs
    }
    assert all(text.startswith('{"items": [{"name": "') for text in completions["json"])
    assert not any(text.startswith('{"items"') for text in completions["none"])
    assert all(c == completions["json"] for r, c in completions.items() if r.startswith("json"))


def test_scenario_runs_follow_each_width_with_their_ratios(tmp_path: Path) -> None:
    plan = JobsPlan(
        shape_name="tiny",
        shape=TINY,
        workloads=(WORKLOADS["w2"].scaled(0.1),),
        taus=(),
        widths=("auto", "full"),
        scratch=tmp_path,
        dtype="float32",
        device="cpu",
        scenarios=("collapse", "mixed rows"),
    )
    entry = run_jobs(plan, lambda _: None)["workloads"]["w2"]
    runs = entry["runs"]
    assert list(runs) == [
        "none",
        "useless auto",
        "collapse auto",
        "mixed rows auto",
        "useless full",
        "collapse full",
        "mixed rows full",
    ]
    for scenario in ("collapse", "mixed rows"):
        for width in ("auto", "full"):
            run = runs[f"{scenario} {width}"]
            assert run["oracle"] and run["scenario"] == scenario and "designed_tau" not in run
            assert run["tokens_per_second"] > 0 and run["error_rows"] == 0
            assert f"{scenario} {width} / none" in entry["ratios"]
        assert f"{scenario} auto / best of none and full" in entry["ratios"]
        # The oracle reached the verify: a full block accepts where the scenario's drafter fits.
        assert runs[f"{scenario} full"]["acceptance_length"] > 1.2, scenario
    # Lossless: every run wrote the no-draft completions (float32).
    written = {run: outputs(tmp_path / "out" / "w2" / run.replace(" ", "-")) for run in runs}
    assert all(o == written["none"] for o in written.values())


def test_scenarios_reach_the_jobs_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    import batchrun.bench.jobs as jobs
    from batchrun.cli import cli

    plans: list[JobsPlan] = []
    monkeypatch.setattr(jobs, "run_jobs", lambda plan, _: plans.append(plan) or {"workloads": {}})
    args = ["bench", "--jobs", "w1", "--scenarios", "collapse,mixed rows", "--device", "cpu"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert plans[0].scenarios == ("collapse", "mixed rows")


@pytest.mark.parametrize(
    "args",
    [
        ["--jobs", "w9"],
        ["--jobs", "w1", "--scenarios", "collapse,nope"],
        ["--jobs", "w1", "--tau", "x"],
        ["--jobs", "w1", "--tau", "0,nan"],
        ["--jobs", "w1", "--job-scale", "-1"],
        ["--jobs", "w1", "--draft-methods", "dflash,eagle"],
        ["--jobs", "w1", "--target", "."],
        ["--jobs", "w1", "--kv-cache-dtype", "auto,fp8"],  # a job runs one KV dtype
        ["--target", ".", "--kv-cache-dtype", "auto,fp8"],
        ["--shape", "qwen3-8b", "--batch-sizes", "1,,-4"],
        ["--shape", "qwen3-8b", "--contexts", "1e9999"],
        ["--shape", "qwen3-8b", "--num-layers", "1"],  # the draft reads layers 1 .. L-3
    ],
)
def test_bad_bench_arguments_are_one_line(args: list[str]) -> None:
    from batchrun.cli import cli

    result = CliRunner().invoke(cli, ["bench", *args, "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_workload_at_another_batch() -> None:
    """NAME@B: the workload at batch B (a batch sweep), named so in the result file."""
    from batchrun.bench.workloads import WORKLOADS, named_workload

    swept = named_workload("w1@256")
    assert swept is not None and swept.name == "w1@256" and swept.batch == 256
    assert swept.rows == WORKLOADS["w1"].rows and named_workload("w1") is WORKLOADS["w1"]
    assert named_workload("w1@0") is None and named_workload("w9") is None
    assert named_workload("w1@x") is None


def test_the_default_batch_is_the_one_run_chooses(tmp_path: Path) -> None:
    """--jobs-default-batch runs each workload at the batch `batchrun run` chooses for it when
    the job sets none: on a CPU, 64 (engine/batch_choice.py)."""
    plan = JobsPlan(
        shape_name="tiny",
        shape=TINY,
        workloads=(WORKLOADS["w2"].scaled(0.05),),
        taus=(),
        widths=(),
        scratch=tmp_path,
        dtype="float32",
        device="cpu",
        default_batch=True,
    )
    entry = run_jobs(plan, lambda _: None)["workloads"]["w2"]
    assert entry["workload"]["batch"] == 64  # run's choice, not the workload's 32
    assert entry["runs"]["none"]["max_batch_size"] == 64
    assert entry["runs"]["none"]["error_rows"] == 0
