"""YaRN (rope_type yarn): the rotary tables are transformers' own, a job's context is factor x
original_max_position_embeddings, and the engine's outputs and prompt log-probabilities beyond
the original context are transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchrun.cli import cli
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny import make_tiny_model
from tests.helpers.engine_runs import cpu_engine, run_to_end

ORIGINAL = 32
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("yarn")
    rope = {**YARN, "rope_theta": 10000.0}
    return make_tiny_model(out, max_position_embeddings=ORIGINAL, rope_parameters=rope)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        {"mscale": 0.707, "mscale_all_dim": 1.0},
        {"attention_factor": 1.3},
    ],
)
def test_tables_are_transformers_own(extra: dict[str, Any]) -> None:
    config = Qwen3Config(
        head_dim=64,
        max_position_embeddings=64,
        rope_parameters={**YARN, "rope_theta": 1_000_000.0, **extra},
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    shape = qwen3_shape(config.to_dict())
    assert shape.max_position_embeddings == 4 * ORIGINAL and shape.rope_scaling is not None
    rope = RotaryEmbedding(64, 200, 1_000_000.0, shape.rope_scaling)
    freqs = torch.outer(torch.arange(200, dtype=torch.float32), inv_freq)
    assert torch.equal(rope.cos, freqs.cos() * scale)
    assert torch.equal(rope.sin, freqs.sin() * scale)


def test_outputs_beyond_the_original_context_are_transformers(yarn_model: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (n,), generator=gen).tolist() for n in (70, 100, 20)]
    engine = cpu_engine(yarn_model, None, max_batch_size=4, prompt_logprobs=0)
    assert engine.max_model_len == 4 * ORIGINAL
    requests = [Request(i, p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
    done = sorted(run_to_end(engine, requests), key=lambda r: r.row_index)
    hf = AutoModelForCausalLM.from_pretrained(yarn_model, dtype=torch.float32).eval()
    for req in done:
        ids = torch.tensor([req.prompt_ids])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=24, do_sample=False)
            logits = hf(ids).logits[0].float()
        assert req.output.token_ids == out[0, ids.shape[1] :].tolist()[: len(req.output.token_ids)]
        expected = logits.log_softmax(-1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        assert req.output.logprobs is not None and req.output.logprobs.prompt is not None
        got = torch.tensor(req.output.logprobs.prompt[1:])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert max(len(r.prompt_ids) + len(r.output.token_ids) for r in done) > 3 * ORIGINAL


def test_validate_reports_the_yarn_context(yarn_model: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["hello"]}), tmp_path / "in.parquet")
    args = ["validate", "--input", str(tmp_path / "in.parquet"), "--target", str(yarn_model)]
    result = CliRunner().invoke(cli, [*args, "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "context 128 (YaRN: 4 x 32)" in result.output


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "longrope", "factor": 8.0}, "rope type 'longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 needs low_freq_factor"),
        ({"rope_type": "yarn", "factor": 4.0}, "yarn needs original_max_position_embeddings"),
        ({**YARN, "factor": 0.5}, r"rope_parameters.factor must be a finite number >= 1 .*0\.5"),
    ],
)
def test_other_scalings_are_refused_in_one_line(
    yarn_model: Path, rope: dict[str, Any], message: str
) -> None:
    config = {**read_config(yarn_model, "target"), "rope_parameters": {**rope, "rope_theta": 1e4}}
    with pytest.raises(JobError, match=message):
        qwen3_shape(json.loads(json.dumps(config)))
