"""The published benchmark tables, generated from result files.

`bench/published.toml` says which result file(s) feed which table of which page; the pages hold
each table between `<!-- table: NAME ... -->` and `<!-- /table: NAME -->`.
`python -m batchrun.bench.tables` rewrites those blocks; `--check` exits 1, a line per stale
block, if any differs from what the files give now. Each block ends with its sources: the file,
the commit (from the file's `provenance`, or for an older file the commit that added it, which
makes the table historical) and the command that measured it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.bench.table_kinds import FILE_KINDS, PAIR_KINDS

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "bench/published.toml"
_BLOCK = re.compile(r"(<!-- table: (\S+) [^\n]*-->\n)(.*?)(<!-- /table: \2 -->)", re.DOTALL)


@dataclass(frozen=True)
class Table:
    name: str
    page: str
    kind: str
    files: list[str] = field(default_factory=list)  # jobs, steady
    pairs: list[dict[str, str]] = field(default_factory=list)  # fp8, demo: role -> file[#series]

    def sources(self) -> list[str]:
        """Every result file the table reads, in manifest order."""
        named = self.files + [ref for pair in self.pairs for ref in pair.values()]
        return list(dict.fromkeys(_split(ref)[0] for ref in named if _is_file(ref)))


def _is_file(ref: str) -> bool:
    return _split(ref)[0].endswith(".json")  # a pair's label (e.g. fp8's `what`) is not


def _split(ref: str) -> tuple[str, str | None]:
    """`path#series` -> (path, series): a series is one summary of a sweep's summary_by_backend."""
    path, _, series = ref.partition("#")
    return path, series or None


def load_manifest(root: Path = ROOT) -> tuple[list[Table], dict[str, str]]:
    """The tables, and the commit that added each result file that has no provenance."""
    data = tomllib.loads((root / MANIFEST).read_text())
    tables = [Table(**entry) for entry in data["table"]]
    for t in tables:
        if t.kind not in FILE_KINDS and t.kind not in PAIR_KINDS:
            raise ValueError(f"{MANIFEST}: table {t.name}: unknown kind {t.kind!r}")
    return tables, data.get("added_in", {})


def table_files(name: str, root: Path = ROOT) -> tuple[Path, ...]:
    """The result files the manifest's table `name` publishes (e.g. the call a fit table
    fits), as paths under root."""
    tables, _ = load_manifest(root)
    (table,) = [t for t in tables if t.name == name]
    return tuple(root / path for path in table.sources())


def render(table: Table, added_in: dict[str, str], root: Path = ROOT) -> str:
    """The block's text: the table, a blank line, then its sources."""
    loaded = {path: _load(root / path) for path in table.sources()}
    if table.kind in FILE_KINDS:
        lines = FILE_KINDS[table.kind]({p: loaded[p] for p in table.files})
    else:
        pairs = [
            {
                role: {"result": loaded[_split(ref)[0]], "series": _split(ref)[1]}
                if _is_file(ref)
                else ref
                for role, ref in pair.items()
            }
            for pair in table.pairs
        ]
        lines = PAIR_KINDS[table.kind](pairs)
    return "\n".join([*lines, "", *caption(loaded, added_in)]) + "\n"


def _load(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def caption(loaded: dict[str, dict[str, Any]], added_in: dict[str, str]) -> list[str]:
    lines = [f"- {source(path, result, added_in.get(path))}" for path, result in loaded.items()]
    return ["Sources:", "", *lines] if len(lines) > 1 else [f"Source: {lines[0][2:]}"]


def source(path: str, result: dict[str, Any], added: str | None) -> str:
    """One file's line: its commit and command. Without provenance the table is historical:
    the file only says it was measured on code at or before the commit that added it."""
    origin = result.get("provenance")
    if origin is None:
        measured = f"at or before `{added}`" if added else "at an unknown commit (not committed)"
        where = f"**historical**: measured on code {measured}; the code has changed since"
        args = result.get("args")
        command = shlex.join(args) if args else None
    else:
        where = f"commit `{origin.get('commit') or 'unknown'}`"
        where += ", dirty tree" if origin.get("dirty") else ""
        device = origin.get("device")
        name = device.get("name") if isinstance(device, dict) else device
        where += f", {name}" if name else ""
        where += f", {origin['time_utc']}" if origin.get("time_utc") else ""
        command = origin.get("command")
    run = f"`{command}`" if command else "not recorded"
    return f"`{path}`, {where}; command: {run}."


def update(root: Path = ROOT, check: bool = False) -> tuple[list[str], list[str]]:
    """Rewrite (with check, only compare) every page's blocks. Returns a line per stale block
    and a line per error (a block without a manifest entry, an entry without a block)."""
    tables, added_in = load_manifest(root)
    stale: list[str] = []
    errors: list[str] = []
    for page in dict.fromkeys(t.page for t in tables):
        text = (root / page).read_text()
        wanted = {t.name: render(t, added_in, root) for t in tables if t.page == page}
        parts, end = [], 0
        for m in _BLOCK.finditer(text):
            name, body = m.group(2), m.group(3)
            parts.append(text[end : m.start(3)])
            end = m.end(3)
            if name not in wanted:
                errors.append(f"{page}: block {name} has no entry in {MANIFEST}")
                parts.append(body)
                continue
            new = wanted.pop(name)
            if body != new:
                stale.append(f"{page}: table {name} is stale ({_difference(body, new)})")
            parts.append(new)
        errors += [f"{page}: no block for table {n} of {MANIFEST}" for n in wanted]
        rewritten = "".join(parts) + text[end:]
        if not check and rewritten != text:
            (root / page).write_text(rewritten)
    return stale, errors


def _difference(old: str, new: str) -> str:
    """How many lines differ, and the first one that does (as the page has it, and as wanted)."""
    a, b = old.splitlines(), new.splitlines()
    changed = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
    first = next(i for i in range(max(len(a), len(b))) if a[i : i + 1] != b[i : i + 1])
    was, wants = (a[first] if first < len(a) else "", b[first] if first < len(b) else "")
    return f"{changed} lines differ; line {first + 1}: {was[:50]!r} -> {wants[:50]!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchrun.bench.tables", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if any block is stale")
    args = parser.parse_args(argv)
    stale, errors = update(check=args.check)
    for line in errors + (stale if args.check else [f"rewrote {s}" for s in stale]):
        print(line)
    return 1 if errors or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
