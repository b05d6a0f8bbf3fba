"""The hybrid benchmark shapes on the CPU at a tiny scale: `bench --shape qwen3.5-9b`, a whole
job on a scratch Qwen3.5 checkpoint, and the roofline's KV and linear state."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from batchrun.bench.jobs import JobsPlan, outputs, run_jobs
from batchrun.bench.roofline import job_bound, state_bytes, step_floor_ms
from batchrun.bench.scratch_models import write_target
from batchrun.bench.shapes import SHAPES, shape_from_flags
from batchrun.bench.workloads import WORKLOADS
from batchrun.cli import cli
from batchrun.engine.device_rates import Ceilings
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.models.qwen3_5 import Qwen3_5Shape, linear_state_bytes, linear_verify_row_bytes

pytestmark = pytest.mark.usefixtures("one_thread_module")
TINY = {"num_layers": 4, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024}


def tiny_hybrid() -> Qwen3_5Shape:
    """qwen3.5-9b's layer pattern and rotary at a width a CPU job runs in seconds."""
    shape = shape_from_flags("qwen3.5-9b", **TINY)
    assert isinstance(shape, Qwen3_5Shape)
    return replace(
        shape,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=1024,
    )


def test_the_sweep_runs_a_hybrid_shape(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "qwen3.5-9b", "--device", "cpu", "--no-hf-eager"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    args += ["--batch-sizes", "2", "--contexts", "16", "--steps", "2", "--hf-compiled-batches", ""]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["setup"]["shape"]["layer_types"].count("full_attention") == 1
    assert {p["mode"] for p in data["points"]} == {"target_only", "dflash"}
    assert all(p["tokens_per_second"] > 0 for p in data["points"])
    assert data["hf_generate"] == []  # no transformers twin of a hybrid
    # The rollback is timed in every verify step, and only there.
    verifying = {p["width"] for p in data["points"] if "rollback_ms" in p}
    widths = {p["width"] for p in data["points"] if p["mode"] == "dflash"}
    assert verifying == widths - {1} and verifying
    assert all(p["mode"] == "dflash" for p in data["points"] if "rollback_ms" in p)
    (row,) = data["summary"]
    shares = row["rollback_share_by_width"]
    assert set(shares) == {str(w) for w in verifying}
    assert all(0 < share < 1 for share in shares.values())


def test_a_hybrid_shape_refuses_tensor_parallelism() -> None:
    result = CliRunner().invoke(cli, ["bench", "--shape", "qwen3.6-27b", "--tp", "2"])
    assert result.exit_code == 2 and "hybrid" in result.output


def test_the_scratch_checkpoint_reads_back_as_its_shape(tmp_path: Path) -> None:
    """The written config.json is a qwen3_5_text the loader reads as the very shape, and the
    tokenizer covers the whole vocabulary."""
    shape = tiny_hybrid()
    target = write_target(tmp_path, shape, torch.float32, "cpu")
    config = read_config(target)
    assert config["model_type"] == "qwen3_5_text"
    assert qwen3_shape(config, "target", target / "config.json") == shape
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(target))) == shape.vocab_size


def test_a_hybrid_job_runs_every_mode_losslessly(tmp_path: Path) -> None:
    plan = JobsPlan(
        shape_name="tiny qwen3.5",
        shape=tiny_hybrid(),
        workloads=(WORKLOADS["w2"].scaled(0.05),),
        taus=(6.5,),
        widths=("auto", "full"),
        scratch=tmp_path,
        dtype="float32",
        device="cpu",
    )
    runs = run_jobs(plan, lambda _: None)["workloads"]["w2"]["runs"]
    assert set(runs) == {"none", "useless auto", "oracle tau 6.5 auto", "useless full"} | {
        "oracle tau 6.5 full"
    }
    assert all(run["error_rows"] == 0 for run in runs.values())
    assert runs["oracle tau 6.5 full"]["acceptance_length"] > 3  # commit replayed the drafts
    written = {run: outputs(tmp_path / "out" / "w2" / run.replace(" ", "-")) for run in runs}
    assert all(o == written["none"] for o in written.values())


def test_the_hybrid_roofline_reads_a_quarter_of_the_kv_and_moves_the_state() -> None:
    s = SHAPES["qwen3.5-9b"]
    assert isinstance(s, Qwen3_5Shape)
    ceilings = Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    state = linear_state_bytes(s, torch.bfloat16)
    kv_token = 8 * 2 * s.num_kv_heads * s.head_dim * 2  # 8 full-attention layers of 32
    short, long = (step_floor_ms(s, 2, 64, c, 1, ceilings) for c in (1000, 2000))
    kv_ms = 64 * 1000 * kv_token / 1e12 * 1e3
    assert long["memory_ms"] - short["memory_ms"] == pytest.approx(kv_ms)
    rows = 2 * 16 * linear_verify_row_bytes(s, torch.bfloat16)  # written, then read once
    assert state_bytes(s, 2) == 2 * state
    assert state_bytes(s, 2, verify_rows=16) == 2 * state + rows  # no pass of the commit's own
    # A step's 64 requests each read and write their 24 layers' state (conv and recurrent).
    assert 24 * 32 * 128 * 128 * 4 < state < 24 * 33 * 128 * 128 * 4
    verify = step_floor_ms(s, 2, 64, 0, 16, ceilings)["memory_ms"]
    plain = step_floor_ms(s, 2, 64, 0, 1, ceilings)["memory_ms"]
    assert verify - plain == pytest.approx(64 * rows / 1e12 * 1e3)  # the kept rows only
    fewer, more = (job_bound(s, 2, [1], [n], 1, ceilings) for n in (100, 101))
    assert more["bytes"] - fewer["bytes"] > 2 * state  # each output moves the state
