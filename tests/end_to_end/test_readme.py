"""The README's quick start is two commands, and CI runs the second exactly as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_the_quick_start_is_two_commands_and_ci_runs_the_tests_one() -> None:
    demo, tests = quick_start_commands()
    assert demo.endswith("batchrun run jobs/demo.toml") and demo.startswith("pip install")
    assert tests.startswith("pip install") and tests.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_the_install_commands_take_the_constraints_and_they_pin_every_dependency() -> None:
    """Both quick-start commands install from constraints.txt, and it pins (==) every package
    that pyproject.toml asks for, the test extra's included: a new machine gets what passed."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    assert all("-c constraints.txt" in command for command in quick_start_commands())
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pinned[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"constraints.txt does not pin {name}"
        assert requirement.specifier.contains(pinned[name]), (name, pinned[name])


def test_the_readme_starts_and_links_into_the_docs() -> None:
    """The README is a start (at most 300 lines); what it leaves out is in docs/, and every
    link from it into docs/ names a page that exists (mkdocs build --strict checks the rest)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert links, "the README links no docs page"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing
