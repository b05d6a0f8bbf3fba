"""The option tables of docs/jobs.md, generated from the options' declarations (config/options.py).

The page holds each table between `<!-- options: NAME ... -->` and `<!-- /options: NAME -->`:
`per-row`, the options a row's cell overrides; `job-keys`, every job key.
`python -m batchrun.config.option_tables` rewrites those blocks; `--check` exits 1, a line per
stale or missing block, if any differs from what the declarations give now.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from batchrun.config.options import JobOption, job_options
from batchrun.sampling.option_rules import requirement

PAGE = Path(__file__).resolve().parents[2] / "docs" / "jobs.md"
_BLOCK = re.compile(r"(<!-- options: (\S+) [^\n]*-->\n)(.*?)(<!-- /options: \2 -->)", re.DOTALL)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _meaning(option: JobOption) -> str:
    return _cell(option.spec.help or option.spec.doc)


def per_row_table() -> list[str]:
    """Each option a row's cell of the same name overrides: its default, rule and meaning."""
    lines = ["| column / key | default | rule | meaning |", "|---|---|---|---|"]
    for option in job_options():
        if option.spec.column:
            rule = _cell(requirement(option.spec))
            default = _cell(option.default_text)
            lines.append(f"| `{option.key}` | {default} | {rule} | {_meaning(option)} |")
    return lines


def job_keys_table() -> list[str]:
    """Every job key, in the job's order: its flag, its default and its meaning."""
    lines = ["| key | flag | default | meaning |", "|---|---|---|---|"]
    for option in job_options():
        flag = f"`--{option.key.replace('_', '-')}`" if option.spec.help else "none"
        default = "required" if option.required else _cell(option.default_text)
        lines.append(f"| `{option.key}` | {flag} | {default} | {_meaning(option)} |")
    return lines


TABLES: dict[str, Callable[[], list[str]]] = {
    "per-row": per_row_table,
    "job-keys": job_keys_table,
}


def update(page: Path = PAGE, check: bool = False) -> list[str]:
    """Rewrite (with check, only compare) the page's blocks. Returns a line per stale block, per
    block of no table, and per table without a block."""
    text = page.read_text()
    wanted = {name: "\n".join(make()) + "\n" for name, make in TABLES.items()}
    problems: list[str] = []
    parts, end = [], 0
    for match in _BLOCK.finditer(text):
        name, body = match.group(2), match.group(3)
        parts.append(text[end : match.start(3)])
        end = match.end(3)
        new = wanted.pop(name, None)
        if new is None:
            problems.append(f"{page.name}: block {name} is no option table")
            parts.append(body)
            continue
        if body != new:
            problems.append(f"{page.name}: option table {name} is stale")
        parts.append(new)
    problems += [f"{page.name}: no block for option table {name}" for name in wanted]
    rewritten = "".join(parts) + text[end:]
    if not check and rewritten != text:
        page.write_text(rewritten)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.config.option_tables", description=__doc__
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if any block is stale")
    args = parser.parse_args(argv)
    problems = update(check=args.check)
    for line in problems:
        print(line)
    missing = any("no block" in line or "no option table" in line for line in problems)
    return 1 if missing or (args.check and problems) else 0


if __name__ == "__main__":
    sys.exit(main())
