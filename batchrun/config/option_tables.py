"""The option tables of docs/jobs.md, generated from the options' declarations (config/options.py).

The page holds each table between `<!-- options: NAME ... -->` and `<!-- /options: NAME -->`:
`per-row`, the options a row's cell overrides; `job-keys`, every job key.
`python -m batchrun.config.option_tables` rewrites those blocks; `--check` exits 1, a line per
stale or missing block, if any differs from what the declarations give now.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from batchrun.config import doc_blocks
from batchrun.config.doc_blocks import update_blocks
from batchrun.config.options import JobOption, job_options
from batchrun.sampling.option_rules import requirement

PAGE = Path(__file__).resolve().parents[2] / "docs" / "jobs.md"


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
    """Rewrite (with check, only compare) the page's blocks: doc_blocks.update_blocks."""
    return update_blocks(page, "options", {name: make() for name, make in TABLES.items()}, check)


def main(argv: list[str] | None = None) -> int:
    return doc_blocks.main("python -m batchrun.config.option_tables", __doc__, update, argv)


if __name__ == "__main__":
    sys.exit(main())
