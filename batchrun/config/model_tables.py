"""docs/models.md's table of the published pairs, generated from their declaration
(config/published_models.py), the model families the loader runs (models/families.py) and the
speculation methods (spec_decode/registry.py), so the page cannot claim a pair the loader or
the registry refuses.

The page holds the table between `<!-- models: published ... -->` and `<!-- /models: published -->`.
`python -m batchrun.config.model_tables` rewrites it; `--check` exits 1, a line per stale or
missing block, if it differs from what the declarations give now.
"""

from __future__ import annotations

import sys
from pathlib import Path

from batchrun.config import doc_blocks
from batchrun.config.doc_blocks import update_blocks
from batchrun.config.published_models import PUBLISHED, PublishedPair
from batchrun.models.families import FAMILIES
from batchrun.spec_decode.registry import METHODS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def runs(pair: PublishedPair) -> str:
    """Whether batchrun runs the pair, and if not, which declaration refuses it."""
    if pair.model_type not in FAMILIES:
        return f"no: model_type `{pair.model_type}` is not a family the loader runs"
    if pair.method not in METHODS:
        return f"no: no speculation method `{pair.method}`"
    return "yes"


def published_table() -> list[str]:
    lines = [
        "| target | model_type | drafter | method | batchrun runs it |",
        "|---|---|---|---|---|",
    ]
    for p in PUBLISHED:
        row = [f"`{p.target}`", f"`{p.model_type}`", f"`{p.drafter}`", p.method, runs(p)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def update(page: Path = PAGE, check: bool = False) -> list[str]:
    """Rewrite (with check, only compare) the page's blocks: doc_blocks.update_blocks."""
    return update_blocks(page, "models", {"published": published_table()}, check)


def main(argv: list[str] | None = None) -> int:
    return doc_blocks.main("python -m batchrun.config.model_tables", __doc__, update, argv)


if __name__ == "__main__":
    sys.exit(main())
