"""FP8 checkpoints (quant_method fp8): a tiny checkpoint quantized block-wise keeps its
projections in FP8 (Fp8Linear; per tensor: dequantized as loaded), and on the CPU each matmul
uses the weight dequantized exactly as transformers defines it (weight x its block's
weight_scale_inv), so the engine's outputs are those of the dequantized checkpoint, which are
transformers' own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from batchrun.cli import cli
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.layers.fp8_linear import Fp8Linear
from batchrun.models.fp8 import Fp8Scheme
from batchrun.models.loader import load_qwen3, qwen3_shape, read_config
from batchrun.sampling.params import SamplingParams
from tests.helpers.engine_runs import cpu_engine, run_to_end
from tests.helpers.fp8_reference import quantize

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = [32, 32]
MAX_TOKENS = 16


def effective_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as the matmuls use them: an FP8 layer's weight dequantized (float32), its
    scales folded into it."""
    fp8 = {
        f"{path}.weight": m.dequantized()
        for path, m in model.named_modules()
        if isinstance(m, Fp8Linear)
    }
    plain = {n: p for n, p in model.named_parameters() if not n.endswith("_scale_inv")}
    return {**plain, **fp8}


@pytest.mark.parametrize(
    ("block", "moe"),
    [(BLOCK, False), (None, False), (BLOCK, True)],
    ids=["dense", "per-tensor", "moe"],
)
def test_fp8_checkpoints_run_as_their_dequantized_weights(
    make_model: Callable[..., Path], tmp_path: Path, block: list[int] | None, moe: bool
) -> None:
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": (1,)} if moe else {}
    fp8 = quantize(make_model(**experts), tmp_path / "fp8", block)
    reference = tmp_path / "fp8-reference"
    loaded, _ = load_qwen3(fp8, "float32", torch.device("cpu"))
    expected, _ = load_qwen3(reference, "float32", torch.device("cpu"))
    # Block-scaled: every projection (q/k/v, o, gate/up, down, each expert's) stays in FP8.
    projections = [m for name, m in loaded.named_modules() if name.endswith("_proj")]
    kept = [m for m in projections if isinstance(m, Fp8Linear)]
    assert len(kept) == (len(projections) if block else 0)
    # moe: layer 0 has 4 experts (gate/up, down each) in place of one MLP; layer 1 is dense
    assert len(projections) == 4 * loaded.shape.num_layers + (4 * 2 - 2 if moe else 0)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    got, want = effective_weights(loaded), dict(expected.named_parameters())
    assert got.keys() == want.keys()
    for name, weight in want.items():
        assert torch.equal(got[name], weight), name
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (n,), generator=gen).tolist() for n in (6, 19, 33)]
    outputs = []
    for model in (fp8, reference):
        requests = [
            Request(i, p, SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts)
        ]
        done = run_to_end(cpu_engine(model, None, max_batch_size=4), requests)
        outputs.append([r.output.token_ids for r in sorted(done, key=lambda r: r.row_index)])
    assert outputs[0] == outputs[1]
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, outputs[0], strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert got == out[0, len(prompt) :].tolist()[: len(got)]


def test_blocks_the_kernels_cannot_step_through_are_dequantized(tiny_model: Path) -> None:
    shape = qwen3_shape(read_config(tiny_model, "target"))
    assert replace(shape, fp8=Fp8Scheme((32, 32))).fp8_block == (32, 32)
    for block in ((32, 16), (32, 48)):  # an fp8 dot's depth is at least 32; a power of two
        assert replace(shape, fp8=Fp8Scheme(block)).fp8_block is None


def test_validate_reports_the_scheme(tiny_model: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fp8 = quantize(tiny_model, tmp_path / "fp8", BLOCK)
    pq.write_table(pa.table({"prompt": ["hello"]}), tmp_path / "in.parquet")
    args = ["validate", "--input", str(tmp_path / "in.parquet"), "--target", str(fp8)]
    result = CliRunner().invoke(cli, [*args, "--output", str(tmp_path / "out"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "FP8 (32 x 32 blocks, block-scaled FP8 matmuls)" in result.output
    # Two ranks would split the 32 rows of k_proj and v_proj into halves of a block.
    result = CliRunner().invoke(
        cli, [*args, "--output", str(tmp_path / "out"), "--device", "cpu", "--tp", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "FP8 (32 x 32 blocks, dequantized as loaded)" in result.output


def test_a_missing_or_misshapen_scale_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    fp8 = quantize(tiny_model, tmp_path / "fp8", BLOCK)
    tensors = load_file(fp8 / "model.safetensors")
    name = next(n for n in tensors if n.endswith("_scale_inv"))
    for broken, message in (
        ({n: t for n, t in tensors.items() if n != name}, "has no|lacks"),
        ({**tensors, name: tensors[name][:1]}, "expected"),
    ):
        save_file(broken, fp8 / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(JobError, match=message) as error:
            load_qwen3(fp8, "float32", torch.device("cpu"))
        assert "\n" not in str(error.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fp8_steps_replay_in_cuda_graphs_as_they_run_eagerly(
    make_model: Callable[..., Path], tmp_path: Path, moe: bool
) -> None:
    """bfloat16 on the GPU: the FP8 matmuls (split K and its per-tile counters included) and the
    FP8 experts give the same tokens captured in the steps' graphs as launched one by one."""
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine

    experts = {"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": (1,)} if moe else {}
    fp8 = quantize(make_model(**experts), tmp_path / "fp8", BLOCK)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (n,), generator=gen).tolist() for n in (6, 19, 33, 70)]
    outputs = []
    for graphs in (False, True):
        config = EngineConfig(
            target=fp8, device="cuda", dtype="bfloat16", max_batch_size=4, cuda_graphs=graphs
        )
        engine = Engine(config)
        assert any(isinstance(m, Fp8Linear) for m in engine.model.modules())
        assert bool(engine.runner.target_graphs) == graphs
        requests = [
            Request(i, p, SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts)
        ]
        done = run_to_end(engine, requests)
        outputs.append([r.output.token_ids for r in sorted(done, key=lambda r: r.row_index)])
    assert outputs[0] == outputs[1]
