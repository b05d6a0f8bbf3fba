"""Qwen3-MoE targets (model_type qwen3_moe) on the CPU: a tiny random checkpoint written by
transformers (4 experts, top 2, one dense layer among sparse ones) loads, and greedy outputs equal
transformers' generate(), with and without a DFlash draft, also where config.json leaves out a key
(transformers' default holds)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.layers.moe import SparseMoe
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.engine_runs import cpu_engine, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def moe_target(make_model: Callable[..., Path]) -> Path:
    return make_model(
        num_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=(1,),
        tie_word_embeddings=False,
    )


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 900, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]


def test_the_shape_reads_the_experts(moe_target: Path) -> None:
    shape = qwen3_shape(read_config(moe_target, "target"))
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (
        4,
        2,
        32,
    )
    assert [shape.sparse(i) for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("with_draft", [False, True])
def test_greedy_outputs_are_transformers(
    moe_target: Path, tmp_path: Path, with_draft: bool
) -> None:
    draft = make_tiny_draft(tmp_path / "draft", moe_target, num_layers=1) if with_draft else None
    assert_greedy_outputs_are_transformers(moe_target, draft)


def test_a_config_without_norm_topk_prob_runs_as_transformers(
    moe_target: Path, tmp_path: Path
) -> None:
    """transformers' Qwen3-MoE leaves the top k's weights unnormalised unless config.json says
    norm_topk_prob: true."""
    target = Path(shutil.copytree(moe_target, tmp_path / "target"))
    config = json.loads((target / "config.json").read_text())
    del config["norm_topk_prob"]
    (target / "config.json").write_text(json.dumps(config))
    assert_greedy_outputs_are_transformers(target, None)


def assert_greedy_outputs_are_transformers(target: Path, draft: Path | None) -> None:
    engine = cpu_engine(target, draft, max_batch_size=3, verify_width="full")
    layers = engine.model.model.layers
    assert [isinstance(layer.mlp, SparseMoe) for layer in layers] == [True, False, True]
    requests = [
        Request(i, p, SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts())
    ]
    done = sorted(run_to_end(engine, requests), key=lambda r: r.row_index)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for req in done:
        ids = torch.tensor([req.prompt_ids])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert req.output.token_ids == out[0, ids.shape[1] :].tolist()[: len(req.output.token_ids)]
        assert len(req.output.token_ids) == MAX_TOKENS or req.output.finish_reason == "stop"


def test_a_bad_expert_count_is_one_line(moe_target: Path) -> None:
    config = {**read_config(moe_target, "target"), "num_experts_per_tok": 5}
    message = r"^target: config.json: num_experts_per_tok must be in \[1, num_experts = 4\], got 5$"
    with pytest.raises(JobError, match=message):
        qwen3_shape(config)


def test_validate_reports_the_experts(moe_target: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from batchrun.cli import cli

    pq.write_table(pa.table({"prompt": ["hello"]}), tmp_path / "in.parquet")
    args = ["validate", "--input", str(tmp_path / "in.parquet"), "--target", str(moe_target)]
    result = CliRunner().invoke(cli, [*args, "--output", str(tmp_path / "out"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "MoE: 4 experts, top 2, context 512" in result.output


def test_a_quantization_other_than_fp8_is_refused_in_one_line(moe_target: Path) -> None:
    config = {**read_config(moe_target, "target"), "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(JobError, match=r"^target: quantized checkpoints \(awq\) are not supported"):
        qwen3_shape(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_experts_under_cuda_graphs_give_transformers_outputs(moe_target: Path) -> None:
    """On a GPU in float32: the fused expert kernel, captured in the steps' CUDA graphs."""
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine

    config = EngineConfig(
        target=moe_target, device="cuda", dtype="float32", max_batch_size=4, cuda_graphs=True
    )
    engine = Engine(config)
    assert engine.runner.target_graphs  # the MoE layers did not keep the graphs off
    requests = [
        Request(i, p, SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts())
    ]
    done = sorted(run_to_end(engine, requests), key=lambda r: r.row_index)
    hf = AutoModelForCausalLM.from_pretrained(moe_target, dtype=torch.float32).cuda().eval()
    for req in done:
        ids = torch.tensor([req.prompt_ids], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert req.output.token_ids == out[0, ids.shape[1] :].tolist()[: len(req.output.token_ids)]
