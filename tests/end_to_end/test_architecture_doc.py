"""docs/architecture.md's layer blocks against the tree: every package and file they name
exists, and every package (at any depth) and every top-level module of batchrun is named, so
the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "batchrun"
NAME_WIDTH = 22  # the blocks' left column: a package, a file or a group of them


def layer_entries() -> dict[str, str]:
    """Each entry of the page's code blocks before 'Who owns what': name cell -> its text."""
    page = (REPO / "docs" / "architecture.md").read_text().split("## Who owns what")[0]
    entries: dict[str, str] = {}
    for block in re.findall(r"```\n(.*?)```", page, flags=re.S):
        name = ""
        for line in block.splitlines():
            if line[:NAME_WIDTH].strip():
                name = line[:NAME_WIDTH].strip()
                entries[name] = ""
            entries[name] += " " + line[NAME_WIDTH:].strip()
    return entries


def _named(entry: str) -> list[str]:
    """The packages and files an entry's name cell names: 'a/', 'a/b.py', 'a.py, b.py'."""
    return [part.strip() for part in entry.split(",")]


def test_every_package_and_file_named_exists() -> None:
    missing = []
    for entry, text in layer_entries().items():
        for name in _named(entry):
            path = PACKAGE / name
            if not path.exists():
                missing.append(name)
            elif path.is_dir():  # the files its text names are in it
                for file in set(re.findall(r"\b([a-z_]+\.py)\b", text)):
                    if not any(path.rglob(file)):
                        missing.append(f"{name}{file}")
    assert not missing, f"docs/architecture.md names what is not in batchrun/: {missing}"


def test_every_package_and_top_level_module_is_named() -> None:
    entries = layer_entries()
    named = {name.rstrip("/") for entry in entries for name in _named(entry)}
    text = " ".join(entries.values())
    unnamed = []
    for init in PACKAGE.rglob("__init__.py"):
        package = init.parent.relative_to(PACKAGE).as_posix()
        if package == ".":
            continue
        parent, _, leaf = package.rpartition("/")
        # a subpackage is named as an entry of its own, or as leaf/ in its parent's text
        inside = parent and re.search(
            rf"(?<![\w/]){re.escape(leaf)}/", entries.get(parent + "/", "")
        )
        if package not in named and not inside:
            unnamed.append(package + "/")
    for module in PACKAGE.glob("*.py"):
        if module.name != "__init__.py" and module.name not in named:
            unnamed.append(module.name)
    assert not unnamed, f"docs/architecture.md does not name: {sorted(unnamed)}"
    assert text  # the blocks were found
