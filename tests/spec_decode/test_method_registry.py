"""The speculation-method registry: a method registered by the test (the bigram drafter of
tests/helpers/bigram_method.py, whose next-token table is its draft's config.json), is chosen
by the draft's `architectures` or by `speculative_method`, checked by preflight and run through
the engine and a whole job, with outputs identical to no draft (speculation is lossless,
whatever a drafter proposes)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import batchrun
from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.config.preflight import preflight
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.models.loader import read_config
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode import registry
from batchrun.spec_decode.registry import choose_method
from tests.helpers.bigram_method import BLOCK, Bigram, learnt_table, write_draft
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def vocab_of(model: Path) -> int:
    return int(read_config(model, "target")["vocab_size"])


def run(target: Path, draft: Path | None, **settings: Any) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (1, 5, 9, 23)]
    jobs = [
        (p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, (20, 13, 24, 9), strict=True)
    ]
    config = {"max_batch_size": 4, "num_pages": 64, "cuda_graphs": False} | settings
    return run_to_end(cpu_engine(target, draft, **config), requests_of(jobs))


def test_the_draft_config_chooses_the_method(bigram: Bigram, tiny_model: Path, tmp_path: Path):
    table = range(vocab_of(tiny_model))
    assert choose_method(write_draft(tmp_path / "b", table)) is bigram
    assert choose_method(write_draft(tmp_path / "d", table, "DFlashDraftModel")).name == "dflash"
    unknown = write_draft(tmp_path / "u", table, "Unknown")
    with pytest.raises(JobError, match=r"architectures \['Unknown'\] is not supported"):
        choose_method(unknown)
    assert choose_method(unknown, "bigram") is bigram  # named: the architectures aside
    with pytest.raises(JobError, match="speculative_method 'nope' is not one of: auto, dflash"):
        choose_method(unknown, "nope")


def test_preflight_checks_the_draft_through_its_method(
    bigram: Bigram, tiny_model: Path, tmp_path: Path
) -> None:
    draft = write_draft(tmp_path / "draft", range(vocab_of(tiny_model)))
    keys = dict(input="in", output="out", target=str(tiny_model), draft=str(draft))
    found = preflight(JobSpec.from_keys(keys))
    assert found.checked is not None and found.checked.method is bigram
    assert found.block_size == BLOCK and found.checked.describe() == "bigram, block size 4"
    write_draft(draft, [0])
    with pytest.raises(JobError, match="next_token must map every token"):
        preflight(JobSpec.from_keys(keys))


@pytest.mark.parametrize("verify_width", ["full", "auto"])
def test_a_registered_method_runs_losslessly_through_the_engine(
    bigram: Bigram, tiny_model: Path, tmp_path: Path, verify_width: str
) -> None:
    plain = run(tiny_model, None)
    vocab = vocab_of(tiny_model)
    for name, table in {
        "learnt": learnt_table(plain, vocab),  # proposes the target's own continuations
        "shifted": [(t + 1) % vocab for t in range(vocab)],  # proposes what it rarely says
    }.items():
        spec = run(tiny_model, write_draft(tmp_path / name, table), verify_width=verify_width)
        for a, b in zip(spec, plain, strict=True):
            assert a.output.token_ids == b.output.token_ids, (name, a.row_index)
            assert a.output.finish_reason == b.output.finish_reason
        rounds = sum(r.output.spec_rounds for r in spec)
        assert rounds > 0, name
        if name == "learnt" and verify_width == "full":  # every round of a full block
            hist = [r.output.spec_hist or [] for r in spec]
            accepted = sum(n * k for h in hist for k, n in enumerate(h))
            assert accepted > rounds, "the learnt table's drafts were accepted"


def test_a_job_runs_through_a_registered_method(
    bigram: Bigram, tiny_model: Path, tmp_path: Path
) -> None:
    prompts = pa.table({"prompt": [f"def step_{i}(state):" for i in range(6)]})
    (tmp_path / "in").mkdir()
    pq.write_table(prompts, tmp_path / "in" / "0.parquet")
    vocab = vocab_of(tiny_model)
    draft = write_draft(tmp_path / "draft", [(t + 1) % vocab for t in range(vocab)])
    outputs = {}
    for name, extra in {"plain": [], "bigram": ["--draft", str(draft)]}.items():
        out = tmp_path / name
        result = CliRunner().invoke(
            cli,
            ["run", "--input", str(tmp_path / "in"), "--output", str(out), "--target",
             str(tiny_model), "--max-tokens", "8", "--quiet", *extra],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))
        outputs[name] = table.sort_by("row_index").column("completion").to_pylist()
        stats = json.loads((out / "stats.json").read_text())
        assert stats["block_size"] == (BLOCK if extra else None)
    assert outputs["bigram"] == outputs["plain"]
    assert registry.METHODS["bigram"] is bigram


def test_engine_config_preflight_and_sizing_import_no_method() -> None:
    """Engine, config and preflight (config/preflight.py) reach a draft only through the
    registry: no import, wherever it stands, of a method's folder in spec_decode/ or of a
    method's draft model in models/."""
    package = Path(batchrun.__file__).parent
    methods = [p.name for p in (package / "spec_decode").iterdir() if (p / "__init__.py").exists()]
    assert "dflash" in methods
    forbidden = tuple(f"batchrun.spec_decode.{m}" for m in methods) + ("batchrun.models.dflash",)
    # config/ holds preflight.py too
    files = [*(package / "engine").rglob("*.py"), *(package / "config").rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.relative_to(package)} imports {bad[0]}"
