"""Generated tables inside a docs page, between `<!-- KIND: NAME ... -->` and `<!-- /KIND: NAME
-->` markers: each page's generator (option_tables.py, model_tables.py) says what its blocks
hold, and this rewrites them, or with --check only reports a stale one."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from pathlib import Path


def update_blocks(
    page: Path, kind: str, wanted: Mapping[str, list[str]], check: bool = False
) -> list[str]:
    """Rewrite (with check, only compare) the page's `kind` blocks with `wanted`'s lines, by
    name. Returns a line per stale block, per block of no table, and per table without a
    block."""
    block = re.compile(rf"(<!-- {kind}: (\S+) [^\n]*-->\n)(.*?)(<!-- /{kind}: \2 -->)", re.DOTALL)
    what = {"options": "option table", "models": "models table"}.get(kind, f"{kind} table")
    text = page.read_text()
    left = {name: "\n".join(lines) + "\n" for name, lines in wanted.items()}
    problems: list[str] = []
    parts, end = [], 0
    for match in block.finditer(text):
        name, body = match.group(2), match.group(3)
        parts.append(text[end : match.start(3)])
        end = match.end(3)
        new = left.pop(name, None)
        if new is None:
            problems.append(f"{page.name}: block {name} is no {what}")
            parts.append(body)
            continue
        if body != new:
            problems.append(f"{page.name}: {what} {name} is stale")
        parts.append(new)
    problems += [f"{page.name}: no block for {what} {name}" for name in left]
    rewritten = "".join(parts) + text[end:]
    if not check and rewritten != text:
        page.write_text(rewritten)
    return problems


def main(
    prog: str, description: str | None, update: Callable[..., list[str]], argv: list[str] | None
) -> int:
    """A generator's command line: rewrite its page, or with --check exit 1 if it is stale; a
    missing block, or a block of no table, fails either way."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if any block is stale")
    args = parser.parse_args(argv)
    problems = update(check=args.check)
    for line in problems:
        print(line)
    missing = any("no block" in line or " is no " in line for line in problems)
    return 1 if missing or (args.check and problems) else 0
