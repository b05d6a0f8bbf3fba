"""`batchrun bench` runs end to end on a tiny pair and reports comparable results (no timings
are checked: speed lives in the benchmark's JSON, not in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.tools.tiny_draft import make_tiny_draft


def test_bench_writes_result_json(tiny_model: Path, tmp_path: Path) -> None:
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4)
    out = tmp_path / "bench.json"
    args = ["bench", "--target", str(tiny_model), "--draft", str(draft), "--device", "cpu"]
    args += ["--num-prompts", "3", "--prompt-len", "8", "--max-tokens", "6", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"target_only", "speculative", "hf_generate"}
    assert data["ratios"]["speculative_outputs_identical"] is True
    target_only = data["results"]["target_only"]
    assert target_only["output_tokens"] == 18  # the random tiny model emits no eos this early
    assert data["results"]["speculative"]["acceptance_length"] >= 1.0
    assert data["setup"]["device"] == "cpu"


def test_bench_compares_n_samples_with_separate_rows(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--target", str(tiny_model), "--device", "cpu", "--no-hf-baseline"]
    args += ["--num-prompts", "3", "--prompt-len", "40", "--max-tokens", "5", "--n", "4"]
    args += ["--profile-batches", "2"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"target_only", "n_4", "separate_rows_4"}
    grouped, separate = data["results"]["n_4"], data["results"]["separate_rows_4"]
    assert 3 * 4 <= grouped["output_tokens"] == separate["output_tokens"] <= 3 * 4 * 5
    assert data["ratios"]["n_4_outputs_identical_to_separate_rows"] is True
    assert data["ratios"]["n_4_vs_separate_rows"] > 0 and data["setup"]["n"] == 4
    assert "aten::" in data["profiles"]["target-only batch 2"]  # steady decode's op table


def test_sweep_projects_full_width_and_adaptive_dflash() -> None:
    """The sweep's projection from measured round times per width: a geometric acceptance
    matching tau, a stats.json profile made conditional, and the adaptive width the policy's
    own rule picks (never slower than the full block)."""
    from batchrun.bench.sweep import conditional_acceptance, geometric_acceptance, summarize
    from batchrun.spec_decode.width_policy import expected_tokens

    accept = geometric_acceptance(6.5, 16)
    assert expected_tokens(accept, 16) == pytest.approx(6.5, abs=1e-6)
    assert conditional_acceptance([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])

    def point(mode: str, width: int, batch: int, ms: float) -> dict:
        extra = {"fraction_of_memory_roofline": 0.7} if mode == "target_only" else {}
        return {
            "mode": mode,
            "width": width,
            "batch": batch,
            "context": 512,
            "ms_per_step": ms,
            "tokens_per_second": batch / ms * 1e3,
            **extra,
        }

    points = [point("target_only", 1, 1, 5.0), point("target_only", 1, 256, 13.0)]
    points += [point("dflash", w, 1, ms) for w, ms in {1: 5.1, 2: 6.4, 4: 6.4, 16: 6.6}.items()]
    points += [point("dflash", w, 256, ms) for w, ms in {1: 13.2, 2: 44, 4: 56, 16: 134}.items()]
    rows = summarize(points, [], {"tau 6.5": accept})
    small, large = (row["dflash"]["tau 6.5"] for row in rows)
    assert small["adaptive_width"] == 16 and small["adaptive_vs_full_width"] == 1.0
    assert small["adaptive_vs_target_only"] == pytest.approx(6.5 * 5.0 / 6.6)
    assert large["adaptive_width"] == 1 and large["adaptive_vs_full_width"] > 1
    assert large["adaptive_vs_target_only"] == pytest.approx(13.0 / 13.2)


def test_backends_side_by_side() -> None:
    from batchrun.bench.sweep import side_by_side

    points = [
        {
            "mode": m,
            "batch": b,
            "context": 1024,
            "width": w,
            "attention_backend": a,
            "ms_per_step": ms,
        }
        for m, b, w, a, ms in [
            ("dflash", 8, 16, "triton", 7.0),
            ("dflash", 8, 16, "flashinfer", 6.5),
            ("target_only", 8, 1, "triton", 5.0),
            ("target_only", 8, 1, "flashinfer", 5.5),
        ]
    ]
    assert side_by_side(points) == [
        {
            "mode": "dflash",
            "batch": 8,
            "context": 1024,
            "width": 16,
            "triton_ms": 7.0,
            "flashinfer_ms": 6.5,
        },
        {
            "mode": "target_only",
            "batch": 8,
            "context": 1024,
            "width": 1,
            "triton_ms": 5.0,
            "flashinfer_ms": 5.5,
        },
    ]


def test_bench_times_the_penalties(tmp_path: Path) -> None:
    """The CPU path of `bench --shape S --penalties` (the GPU run measures their cost)."""
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "qwen3-8b", "--penalties", "--device", "cpu"]
    args += ["--num-layers", "4", "--hidden-size", "256", "--intermediate-size", "512"]
    args += ["--vocab-size", "1024", "--batch-sizes", "1,4", "--contexts", "16", "--steps", "2"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [p["batch"] for p in data["points"]] == [1, 4]
    assert all(p["ratio"] > 0 for p in data["points"])
    assert set(data["ratios"]) == {"batch_1_penalties_vs_plain", "batch_4_penalties_vs_plain"}


def test_sweep_runs_each_kv_cache_dtype(tmp_path: Path) -> None:
    """The CPU path of `bench --shape S --kv-cache-dtype auto,fp8`: each KV dtype's engine
    sweeps every point, side by side (the GPU run measures the difference)."""
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "qwen3-8b", "--device", "cpu", "--no-draft", "--no-hf-eager"]
    args += ["--num-layers", "4", "--hidden-size", "256", "--intermediate-size", "512"]
    args += ["--vocab-size", "1024", "--batch-sizes", "2", "--contexts", "16", "--steps", "2"]
    args += ["--hf-compiled-batches", "", "--kv-cache-dtype", "auto,fp8"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [p["kv_cache_dtype"] for p in data["points"]] == ["auto", "fp8"]
    assert data["setup"]["kv_cache_dtypes"] == ["auto", "fp8"]
    (row,) = data["step_ms_by_backend"]
    assert row["torch_ms"] > 0 and row["torch-fp8kv_ms"] > 0
    assert set(data["summary_by_backend"]) == {"torch", "torch-fp8kv"}
    refused = CliRunner().invoke(cli, [*args[:-1], "fp9"])
    assert refused.exit_code == 2 and len(refused.stderr.splitlines()) == 1
    assert "expected auto, fp8 or a comma list of them" in refused.stderr


def test_the_roofline_counts_fp8_projections_and_experts_at_a_byte() -> None:
    from batchrun.bench.roofline import weight_bytes
    from batchrun.bench.shapes import shape_from_flags

    bf16 = shape_from_flags("qwen3-30b-a3b")
    fp8 = shape_from_flags("qwen3-30b-a3b", fp8_weights=True)
    s, read = bf16, 10
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    attention = s.hidden_size * (q + 2 * kv) + q * s.hidden_size
    experts = read * 3 * s.hidden_size * s.moe_intermediate_size
    # bf16's two bytes an element less FP8's one: the projections' elements, once each
    saved = weight_bytes(bf16, 2, experts=read) - weight_bytes(fp8, 2, experts=read)
    assert saved == s.num_layers * (attention + experts)


def test_a_moe_job_bound_counts_the_experts_a_token_and_a_step_use() -> None:
    """Qwen3-30B-A3B: a token's matmuls use its 8 experts (about 3B parameters, not 30B); a
    decode step at batch 128 reads nearly every expert."""
    from batchrun.bench.roofline import job_bound, weight_bytes
    from batchrun.bench.shapes import shape_from_flags
    from batchrun.engine.device_rates import Ceilings

    s = shape_from_flags("qwen3-30b-a3b")
    ceilings = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    prefill = job_bound(s, 2, [1000], [1], 1, ceilings)
    assert 2.5e9 < prefill["flops"] / (2 * 1001) < 3.5e9
    decode = job_bound(s, 2, [1], [100], 128, ceilings)  # 100 steps, 1 row: one step's bytes
    all_experts = weight_bytes(s, 2)
    assert 0.99 * all_experts < decode["bytes"] / 100 <= all_experts


def test_an_fp8_job_is_held_to_fp8_ceilings() -> None:
    """FP8 weights: compute at the FP8 matmul rate; an FP8 KV cache: a byte per K/V element."""
    from batchrun.bench.roofline import job_bound
    from batchrun.bench.shapes import shape_from_flags
    from batchrun.engine.device_rates import Ceilings

    bf16, fp8 = shape_from_flags("qwen3-8b"), shape_from_flags("qwen3-8b", fp8_weights=True)
    ceilings = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15, fp8_matmul_flops_per_s=2e15)
    prefill = [4096] * 8, [1] * 8  # compute-bound
    assert job_bound(fp8, 2, *prefill, 8, ceilings)["compute_seconds"] == pytest.approx(
        job_bound(bf16, 2, *prefill, 8, ceilings)["compute_seconds"] / 2
    )
    unmeasured = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    assert job_bound(fp8, 2, *prefill, 8, unmeasured)["flops"] / 1e15 == pytest.approx(
        job_bound(fp8, 2, *prefill, 8, unmeasured)["compute_seconds"]
    )
    decode = [1024], [256]  # one row: its KV reads beside the weights, 256 steps
    two, one = (job_bound(bf16, 2, *decode, 1, ceilings, kv) for kv in (None, 1))
    s = bf16
    kv_read = s.num_layers * 2 * s.num_kv_heads * s.head_dim * (1024 * 256 + 256 * 255 / 2)
    assert two["bytes"] - one["bytes"] == pytest.approx(kv_read)


def test_a_job_has_an_overlap_bound_and_a_serial_one() -> None:
    """W1's shape (1,024 in, 256 out, batch 128): the overlap bound is the larger of the job's
    compute and memory; the serial one the prompts' compute plus decoding at the larger of its
    own compute and the memory, so it lies between that and the sum of the two."""
    from batchrun.bench.roofline import job_bound
    from batchrun.bench.shapes import shape_from_flags
    from batchrun.engine.device_rates import Ceilings

    s = shape_from_flags("qwen3-8b")
    ceilings = Ceilings(copy_bytes_per_s=3.3e12, matmul_flops_per_s=7.6e14)
    w1 = job_bound(s, 2, [1024] * 256, [256] * 256, 128, ceilings)
    compute, memory = w1["compute_seconds"], w1["memory_seconds"]
    assert w1["bound_seconds"] == max(compute, memory)
    assert max(compute, memory) < w1["serial_bound_seconds"] < compute + memory
    prompts_only = job_bound(s, 2, [1024] * 256, [0] * 256, 128, ceilings)
    prefill = prompts_only["compute_seconds"]
    assert w1["serial_bound_seconds"] == pytest.approx(prefill + max(compute - prefill, memory))
