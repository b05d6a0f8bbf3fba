"""The batch a job runs at when it sets none (engine/batch_size.py), with the H100's numbers: the
decode step's cost fitted to its step times (tests/fixtures/, issue 46) and its memory simulated
(80 GB, Qwen3-8B's weights loaded)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from batchrun.bench.replay.fitted import FittedCosts, fit_costs
from batchrun.bench.replay.job import Job, replay
from batchrun.bench.shapes import SHAPES
from batchrun.engine.batch_size import DecodeCost, default_batch_size
from batchrun.engine.config import EngineConfig
from batchrun.engine.memory import kv_pages

FIXTURES = Path(__file__).parents[1] / "fixtures"
QWEN3_8B = SHAPES["qwen3-8b"]
H100_BYTES = 85_031_714_816  # what torch says of an H100 80GB HBM3
WEIGHT_BYTES = 16_381_000_000  # Qwen3-8B in bfloat16


@cache
def h100_costs() -> FittedCosts:
    return fit_costs(json.loads((FIXTURES / "h100-jobs-w2-b1-drafts.json").read_text())).costs


def h100_decode() -> DecodeCost:
    c = h100_costs()
    return DecodeCost(c.weights_ms, c.ms_per_kv_token, c.ms_per_row)


def h100_pages(batch: int) -> int:
    """The KV pages memory.py sizes for a batch on the H100, no draft."""
    config = EngineConfig(target=Path("unused"), max_batch_size=batch)
    memory = (H100_BYTES, WEIGHT_BYTES)
    return kv_pages(
        config, QWEN3_8B, None, 0, 2, 1, torch.device("cpu"),
        draft_paged_layers=0, ring_pages=0, memory=memory,
    )  # fmt: skip


def test_w1_on_the_h100_runs_at_the_batch_its_pages_hold() -> None:
    """W1's decode steps stay memory-bound at any batch on the H100 (a request's 1,152 tokens
    of K/V take longer to read than its row's matmuls), so the pages decide: 256 rows of 1,280
    tokens fit beside a batch of 256's graphs, 512 do not."""
    batch = default_batch_size(h100_decode(), 1024, 256, h100_pages, page_size=16)
    assert batch == 256
    assert h100_pages(256) >= 256 * 80 > h100_pages(512) * 256 / 512


def test_longer_rows_get_a_smaller_batch() -> None:
    assert default_batch_size(h100_decode(), 8192, 1024, h100_pages, page_size=16) == 32


def test_the_batch_stops_where_the_step_turns_compute_bound() -> None:
    """Past 6 ms / 0.05 ms = 120 rows the matmuls outlast the weights' reading: the first batch
    past it is the last doubled to."""
    cost = DecodeCost(weights_ms=6.0, ms_per_kv_token=0.0, ms_per_row=0.05)
    plenty = lambda batch: 1 << 30  # noqa: E731
    assert default_batch_size(cost, 1024, 256, plenty, page_size=16) == 128
    assert default_batch_size(cost, 1024, 256, plenty, page_size=16, limit=64) == 64


def test_the_fitted_replay_ranks_the_w1_sweep_as_the_h100_measured_it() -> None:
    """The H100 fit replays W1 at batch 64 and 128 as the H100 ran them (3,796 against 4,660
    tok/s, within 3%), and ranks the batch the rule picks (256) above both."""
    measured = {
        64: json.loads((FIXTURES / "h100-jobs-w1-default-batch.json").read_text()),
        128: json.loads((FIXTURES / "h100-jobs-w1-w2-nodraft-generate.json").read_text()),
    }
    tps = {
        b: r["workloads"]["w1"]["runs"]["none"]["tokens_per_second"] for b, r in measured.items()
    }
    for b, r in measured.items():
        assert r["workloads"]["w1"]["workload"]["batch"] == b
    w1 = {b: Job(rows=256, prompt_len=1024, max_tokens=256, batch=b) for b in (64, 128, 256)}
    played = {b: replay(job, None, costs=h100_costs()).tokens_per_second for b, job in w1.items()}
    assert played[64] / played[128] == pytest.approx(tps[64] / tps[128], rel=0.03)
    assert played[256] > played[128] > played[64]
