"""The wheel holds the runtime only: the benchmark harness, the demo trainer and the tiny-model
tools stay in the source checkout, and where they are absent `batchrun bench` says in one line
how to get them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]
HARNESS = ("batchrun.bench", "batchrun.train", "batchrun.tools")


def test_the_wheel_leaves_the_harness_out_and_holds_every_other_package() -> None:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packaged = set(find_packages(REPO, **find["find"]))
    every = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "batchrun").rglob("__init__.py")
    }
    harness = {p for p in every if p.startswith(HARNESS)}
    assert harness and not packaged & harness, packaged & harness
    assert packaged == every - harness, every - harness ^ packaged


def test_bench_without_the_harness_says_what_to_install_in_one_line() -> None:
    code = (
        "import sys; sys.modules['batchrun.bench'] = None\n"
        "from batchrun.cli import main; sys.argv = ['batchrun', 'bench', '--jobs']; main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "source checkout" in lines[0], done.stderr
