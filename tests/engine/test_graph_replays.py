"""Decode-only steps replay the target's CUDA graphs (emulated off a GPU): without a draft the
width-1 graphs, with a drafter that writes its context the width-1 graphs that store it, and
with a dormant one the quiet graphs. An eager fallback would keep outputs right and only be slow,
so only the replay counts can catch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrun.sampling.params import SamplingParams
from tests.helpers.engine_runs import cpu_engine, requests_of, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread_module")


def test_a_target_alone_replays_its_width_1_graphs(tiny_model: Path) -> None:
    engine = cpu_engine(tiny_model, None, max_batch_size=8, num_pages=256)
    engine.capture_graphs()  # off a GPU only when asked: emulated
    engine.instruments.steps = []  # the step trace says which steps replayed
    jobs = [([5 + i, 7, 9], SamplingParams(max_tokens=12)) for i in range(8)]
    run_to_end(engine, requests_of(jobs))
    replayed = {name for (name, _) in engine.runner.replays}
    assert replayed == {"target1"}, engine.runner.replays
    assert sum(engine.runner.replays.values()) >= 8
    steps = engine.instruments.steps
    decode = [s.replayed for s in steps if s.kind == "decode"]
    assert decode and all(decode)
    # the pipeline launches a step before it reads the one that finishes the last request:
    # that one replays and is never read
    assert sum(engine.runner.replays.values()) - sum(decode) in (0, 1)
    assert not any(s.replayed for s in steps if s.kind != "decode")
