"""docs/jobs.md's option tables are generated from the declarations: the committed page is what
the generator writes, every declared option is in its table, and an option declared anew makes
the page stale until it is regenerated."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchrun.config import option_tables, options
from batchrun.config.option_tables import PAGE, update
from batchrun.sampling.params import SamplingParams
from tests.job.test_options import ExtendedParams


def _keys(page: Path, name: str) -> list[str]:
    """The keys listed in one block of the page, in order."""
    block = re.search(
        rf"<!-- options: {name} .*?-->\n(.*?)<!-- /options: {name} -->", page.read_text(), re.DOTALL
    )
    assert block is not None, f"{page.name} has no {name} block"
    return re.findall(r"^\| `(\w+)` \|", block.group(1), re.MULTILINE)


def test_the_committed_page_is_up_to_date() -> None:
    assert update(check=True) == [], "run python -m batchrun.config.option_tables"


def test_every_declared_option_is_in_its_table() -> None:
    assert _keys(PAGE, "job-keys") == [option.key for option in options.job_options()]
    columns = [option.key for option in options.job_options() if option.spec.column]
    assert _keys(PAGE, "per-row") == columns


@pytest.fixture
def extended(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    parts = tuple((n, ExtendedParams if c is SamplingParams else c) for n, c in options.PARTS)
    monkeypatch.setattr(options, "PARTS", parts)
    options.job_options.cache_clear()
    yield
    options.job_options.cache_clear()


@pytest.mark.usefixtures("extended")
def test_a_new_option_makes_the_page_stale_until_regenerated(tmp_path: Path) -> None:
    page = tmp_path / "jobs.md"
    page.write_text(PAGE.read_text())
    assert update(page, check=True) == [
        "jobs.md: option table job-keys is stale",  # in the page's order
        "jobs.md: option table per-row is stale",
    ]
    update(page)
    assert update(page, check=True) == []
    assert "typical_p" in _keys(page, "per-row") and "typical_p" in _keys(page, "job-keys")
    lines = page.read_text().splitlines()
    assert "| `typical_p` | 1.0 | in (0, 1] | Locally typical sampling mass; 1 = off. |" in lines
    assert (
        "| `typical_p` | `--typical-p` | 1.0 | Locally typical sampling mass; 1 = off. |" in lines
    )


def test_a_missing_block_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "jobs.md"
    page.write_text(
        re.sub(
            r"<!-- options: job-keys .*?<!-- /options: job-keys -->",
            "",
            PAGE.read_text(),
            flags=re.DOTALL,
        )
    )
    assert update(page, check=True) == ["jobs.md: no block for option table job-keys"]
    assert option_tables.main(["--check"]) == 0  # the repository's page is untouched
