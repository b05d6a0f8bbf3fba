"""docs/models.md's table of the published pairs agrees with what loads: the page is what the
declarations give, every pair it says runs has a target config.json (transformers' own for its
model_type) that the loader reads, and every pair it says does not is refused by the loader."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from batchrun.config.model_tables import runs, update
from batchrun.config.published_models import PUBLISHED, PublishedPair
from batchrun.errors import JobError
from batchrun.models.families import family_of
from batchrun.models.loader import qwen3_shape
from batchrun.spec_decode.registry import METHODS


def test_the_page_is_current() -> None:
    assert update(check=True) == []


@pytest.mark.parametrize("pair", PUBLISHED, ids=lambda p: p.target)
def test_a_row_agrees_with_the_loader(pair: PublishedPair) -> None:
    config = {"model_type": pair.model_type}
    if runs(pair) != "yes":
        with pytest.raises(JobError, match="model_type"):
            family_of(config, "target")
        return
    assert pair.method in METHODS
    written = AutoConfig.for_model(pair.model_type).to_dict()  # as its checkpoint has it
    assert qwen3_shape(written, "target").num_layers > 0


def test_a_stale_page_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "models.md"
    page.write_text("<!-- models: published x -->\n| old |\n<!-- /models: published -->\n")
    assert update(page, check=True) == ["models.md: models table published is stale"]
    update(page)
    assert update(page, check=True) == []
