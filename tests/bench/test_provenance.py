"""Every result `batchrun bench` writes says where it comes from; `--help` says what --tau does;
the transformers baseline is timed several times and says "compiled" only when it was."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from click.testing import CliRunner

from batchrun.cli import cli

REPO = Path(__file__).resolve().parents[2]


def test_a_result_file_records_its_provenance(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--target", str(tiny_model), "--device", "cpu", "--no-hf-baseline"]
    args += ["--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "3", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    origin = json.loads(out.read_text())["provenance"]
    assert set(origin) == {"commit", "dirty", "device", "versions", "command", "time_utc"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert origin["commit"] == head.stdout.strip() and isinstance(origin["dirty"], bool)
    assert set(origin["device"]) == {"name", "driver", "cuda"} and origin["device"]["name"]
    versions = origin["versions"]
    assert set(versions) == {"python", "torch", "triton", "transformers"}
    assert versions["torch"] == torch.__version__ and versions["transformers"]
    assert origin["command"] and origin["time_utc"].endswith("+00:00")


def test_help_says_what_tau_does_in_each_mode() -> None:
    result = CliRunner().invoke(cli, ["bench", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output[result.output.index("--tau") :].split())
    assert "--shape (steady state): the taus to project" in text
    assert "--jobs: the target tau of the acceptance oracle" in text
    assert "the oracle exists only in the benchmark" in text


def test_the_transformers_baseline_is_timed_three_times(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from batchrun.bench.end_to_end import run_hf_generate
    from batchrun.bench.hf_baseline import decode_ms_per_step

    def check(result: dict, key: str) -> None:
        runs = result[f"{key}_runs"]
        assert len(runs["runs"]) >= 3 and runs["min"] <= runs["median"] <= runs["max"]
        assert result[key] == runs["median"] and result["compiled"] is False

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompts = torch.randint(0, 50, (2, 8))
    check(decode_ms_per_step(model, prompts, 3, static_cache=False), "ms_per_step")
    whole = run_hf_generate(tiny_model, prompts.tolist(), 3, torch.float32, torch.device("cpu"))
    check(whole, "wall_seconds")


def test_compiled_is_what_dynamo_observed(tiny_model: Path) -> None:
    """On the CPU generate() compiles nothing with a static cache unless told to: "compiled"
    follows dynamo's counter, not the absence of an exception."""
    from transformers import AutoModelForCausalLM, CompileConfig

    from batchrun.bench.hf_baseline import decode_ms_per_step, generate_job

    prompts = torch.randint(0, 50, (2, 8))
    job = generate_job(tiny_model, prompts.tolist(), [3, 3], 2, torch.float32, torch.device("cpu"))
    assert job["mode"] == "static cache" and job["compiled"] is False
    assert len(job["seconds_runs"]["runs"]) >= 3

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    assert decode_ms_per_step(model, prompts, 2, static_cache=True)["compiled"] is False
    config = CompileConfig(backend="eager", fullgraph=False)  # dynamo only: no C++ compile
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    model.generation_config.compile_config = config
    compiled = decode_ms_per_step(model, prompts, 2, static_cache=True)
    assert compiled["compiled"] is True and compiled["compiled_frames"] > 0
    assert compiled["compile_seconds"] is not None


def test_a_named_source_commit_wins_over_a_lagging_checkout(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A device machine's copy of the tree carries a .git whose HEAD lags its files: the commit
    the call names is recorded, git's own view beside it."""
    from batchrun.bench import provenance

    monkeypatch.setenv("BATCHRUN_SOURCE_COMMIT", "0" * 40)
    origin = provenance._git(REPO / "batchrun")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert origin["commit"] == "0" * 40 and origin["dirty"] is None
    assert origin["git_head"] == head.stdout.strip() and isinstance(origin["git_dirty"], bool)
