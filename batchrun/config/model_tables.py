"""docs/models.md's table of the published pairs, generated from their declaration
(config/published_models.py), the model families the loader runs (models/families.py) and the
speculation methods (spec_decode/registry.py), so the page cannot claim a pair the loader or
the registry refuses.

The page holds the table between `<!-- models: published ... -->` and `<!-- /models: published -->`.
`python -m batchrun.config.model_tables` rewrites it; `--check` exits 1, a line per stale or
missing block, if it differs from what the declarations give now.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from batchrun.config.published_models import PUBLISHED, PublishedPair
from batchrun.models.families import FAMILIES
from batchrun.spec_decode.registry import METHODS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
_BLOCK = re.compile(r"(<!-- models: (\S+) [^\n]*-->\n)(.*?)(<!-- /models: \2 -->)", re.DOTALL)


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
    """Rewrite (with check, only compare) the page's block. Returns a line per problem: a stale
    block, a block of no table, no block."""
    text = page.read_text()
    wanted = {"published": "\n".join(published_table()) + "\n"}
    problems: list[str] = []
    parts, end = [], 0
    for match in _BLOCK.finditer(text):
        name, body = match.group(2), match.group(3)
        parts.append(text[end : match.start(3)])
        end = match.end(3)
        new = wanted.pop(name, None)
        if new is None:
            problems.append(f"{page.name}: block {name} is no models table")
            parts.append(body)
            continue
        if body != new:
            problems.append(f"{page.name}: models table {name} is stale")
        parts.append(new)
    problems += [f"{page.name}: no block for models table {name}" for name in wanted]
    rewritten = "".join(parts) + text[end:]
    if not check and rewritten != text:
        page.write_text(rewritten)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.config.model_tables", description=__doc__
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    problems = update(check=args.check)
    for line in problems:
        print(line)
    missing = any("no block" in line or "no models table" in line for line in problems)
    return 1 if missing or (args.check and problems) else 0


if __name__ == "__main__":
    sys.exit(main())
