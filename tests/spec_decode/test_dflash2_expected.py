"""batchrun's DFlash2 rounds against the reference's, committed once by
tests/helpers/dflash2_expected.py (tests/fixtures/dflash2_rounds.json): the same target and
drafter rebuilt from their seeds, every round's anchor, drafts and committed tokens equal, so
the proposals, the acceptance lengths and the output are the reference loop's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchrun.sampling.params import SamplingParams
from tests.helpers.dflash2_expected import DRAFT, FIXTURE, MAX_TOKENS, build_pair, prompts
from tests.helpers.dflash_reference import RefRound
from tests.spec_decode.test_dflash_engine import rounds_of, run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rounds_equal_the_committed_reference(tmp_path: Path) -> None:
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["draft"] == DRAFT, "rerun python -m tests.helpers.dflash2_expected"
    target, draft = build_pair(tmp_path)
    jobs = [(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts()]
    engine, finished = run(target, draft, jobs)
    for row, (req, expected) in enumerate(zip(finished, fixture["runs"], strict=True)):
        assert req.output.token_ids == expected["output"], f"row {row}"
        want = [RefRound(p, a, d, c) for p, a, d, c in expected["rounds"]]
        assert rounds_of(engine, row) == want, f"row {row}"
