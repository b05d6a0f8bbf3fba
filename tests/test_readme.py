"""The README's quick start is two commands, and CI runs the second exactly as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
