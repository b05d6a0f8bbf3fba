"""Llama 3 targets (LlamaForCausalLM, llama3 rope scaling, no q/k norm): greedy tokens of the
engine equal transformers' generate() on a tiny checkpoint that transformers wrote; configs
batchrun does not run are refused in one line; `validate` names the family; a DFlash draft
with Llama layers on a Llama target leaves the target's output as it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchrun.cli import cli
from batchrun.errors import JobError
from batchrun.layers.rotary import Llama3
from batchrun.models.loader import qwen3_shape
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end
from tests.helpers.llama_models import LLAMA3_ROPE, make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread_module")

PROMPTS = [[5, 17, 300, 41], [9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 7, 8], [33, 34]]
MAX_TOKENS = [24, 16, 20, 12]
SHAPES = {
    "llama3-rope-untied": {},
    "plain-rope-tied-no-head-dim": {"rope_parameters": None, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module", params=list(SHAPES))
def llama(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    path = make_tiny_llama(out, tokenizer_dir, **SHAPES[request.param])
    if request.param.endswith("no-head-dim"):  # hidden / heads, as transformers reads it
        config = json.loads((path / "config.json").read_text())
        del config["head_dim"]
        (path / "config.json").write_text(json.dumps(config))
    return path


def generated(path: Path, prompt: list[int], max_new: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new
    )
    return out[0, len(prompt) :].tolist()


def jobs() -> list[tuple[list[int], SamplingParams]]:
    return [
        (p, SamplingParams(max_tokens=m, ignore_eos=True))
        for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]


def test_greedy_tokens_equal_generate(llama: Path) -> None:
    engine = cpu_engine(llama, None, max_batch_size=4, max_batched_tokens=16, num_pages=64)
    finished = run_to_end(engine, requests_of(jobs()))
    for req, prompt, max_new in zip(finished, PROMPTS, MAX_TOKENS, strict=True):
        assert req.output.token_ids == generated(llama, prompt, max_new), req.row_index


def test_a_dflash_draft_with_llama_layers_leaves_the_output_as_it_is(
    llama: Path, tmp_path: Path
) -> None:
    draft = make_tiny_draft(
        tmp_path / "draft",
        llama,
        num_layers=2,
        block_size=4,
        target_layer_ids=[0, 1],
        layers="llama",
    )
    settings: dict[str, Any] = {"max_batch_size": 4, "max_batched_tokens": 32, "num_pages": 96}
    alone = run_to_end(cpu_engine(llama, None, **settings), requests_of(jobs()))
    drafted = run_to_end(cpu_engine(llama, draft, **settings), requests_of(jobs()))
    assert [r.output.token_ids for r in drafted] == [r.output.token_ids for r in alone]


def test_llama3_frequencies_are_transformers(tokenizer_dir: Path) -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(LLAMA3_ROPE))
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    rope = Llama3(8.0, 1.0, 4.0, 64)
    assert torch.equal(rope.inv_freq(16, 500_000.0, torch.device("cpu")), want)
    assert rope.scale() == scale


def minimal(**keys: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_theta": 500_000.0,
    } | keys


def test_a_minimal_config_reads_as_transformers_reads_it() -> None:
    shape = qwen3_shape(minimal())
    hf = LlamaConfig(**minimal())
    assert (shape.head_dim, shape.num_kv_heads) == (hf.head_dim, hf.num_key_value_heads)
    assert shape.qk_norm is False and shape.rope_scaling is None
    assert shape.tie_word_embeddings is hf.tie_word_embeddings


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"attention_bias": True}, "attention_bias is true"),
        ({"mlp_bias": True}, "mlp_bias is true"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope type 'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_what_batchrun_does_not_run_is_refused_in_one_line(
    keys: dict[str, Any], message: str
) -> None:
    with pytest.raises(JobError, match=message) as error:
        qwen3_shape(minimal(**keys))
    assert "\n" not in str(error.value)


def test_validate_names_the_family(llama: Path, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": ["def step(state):"]}), tmp_path / "in" / "0.parquet")
    draft = make_tiny_draft(tmp_path / "draft", llama, block_size=4, layers="llama")
    args = ["validate", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, [*args, "--target", str(llama), "--draft", str(draft)])
    assert result.exit_code == 0, result.output
    assert f"target: {llama} (llama: 2 layers" in result.output
