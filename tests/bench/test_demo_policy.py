"""`batchrun bench --demo-policy`'s inputs: a drafter of the demo draft's shape that proposes
what the target would not, and the demo prompts whose second half is sampled hot."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from batchrun.bench.demo_policy import (
    COLLAPSE_TEMPERATURE,
    _ratios_by_round,
    demo_job_file,
    write_collapsing_input,
    write_useless_draft,
)
from batchrun.config.job import load_job


def test_the_useless_draft_keeps_the_demo_drafts_shapes_not_its_weights(tmp_path: Path) -> None:
    demo = load_job(demo_job_file())
    draft = Path(str(demo.value("draft")))
    useless = write_useless_draft(draft, tmp_path / "useless")
    old, new = (
        load_file(str(draft / "model.safetensors")),
        load_file(str(useless / "model.safetensors")),
    )
    assert old.keys() == new.keys()
    assert (useless / "config.json").read_text() == (draft / "config.json").read_text()
    for name, tensor in old.items():
        assert new[name].shape == tensor.shape and new[name].dtype == tensor.dtype
        if tensor.dim() >= 2:  # matrices replaced at their own scale, norms kept
            assert not new[name].equal(tensor), name
            ratio = new[name].float().std() / tensor.float().std()
            assert 0.8 < ratio < 1.25, name
        else:
            assert new[name].equal(tensor), name


def test_the_collapsing_input_samples_its_second_half_hot(tmp_path: Path) -> None:
    demo = load_job(demo_job_file())
    prompts = Path(str(demo.value("input")))
    table = pq.read_table(write_collapsing_input(prompts, tmp_path / "c.parquet"))
    n = table.num_rows
    assert n == pq.read_metadata(prompts).num_rows
    temperature = table["temperature"].to_pylist()
    assert temperature == [0.0] * (n // 2) + [COLLAPSE_TEMPERATURE] * (n - n // 2)
    assert len(set(table["seed"].to_pylist())) == n


def test_ratios_pair_the_modes_of_each_round() -> None:
    """A machine that slows between rounds slows every mode of the round alike: the round's
    ratio sees none of it (here auto is 0.9 of no draft in every round, full slower still)."""
    speed = [1.0, 0.5, 2.0]
    rates = {
        ("job", "none"): [100 * s for s in speed],
        ("job", "auto"): [90 * s for s in speed],
        ("job", "full"): [50 * s for s in speed[:2]],  # a round cut short: no full yet
    }
    by_round = _ratios_by_round(rates, "job")
    assert by_round["auto / none"] == pytest.approx([0.9] * 3)
    assert by_round["auto / best of none and full"] == pytest.approx([0.9] * 3)
    rates["job", "full"] = [200 * s for s in speed]  # full the better: auto against it
    by_round = _ratios_by_round(rates, "job")
    assert by_round["auto / best of none and full"] == pytest.approx([0.45] * 3)
