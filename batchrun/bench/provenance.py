"""Where a result file comes from: the commit (and whether the tree was dirty), the machine,
the library versions, the exact command and the time. Every result `batchrun bench` writes
carries it."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import batchrun


def provenance() -> dict[str, Any]:
    """This process's provenance record (one per `batchrun bench` run)."""
    return {
        **_git(Path(batchrun.__file__).resolve().parent),
        "device": _device(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
        },
        "command": shlex.join(sys.argv),
        "time_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _run(args: list[str], cwd: Path) -> str | None:
    """A command's stripped stdout, or None where it fails or is missing."""
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git(package: Path) -> dict[str, Any]:
    """The commit of the checkout the package was imported from, and whether tracked files
    differ from it (untracked files, e.g. new results, do not count). BATCHRUN_SOURCE_COMMIT,
    where set, names the commit instead: a tree exported by `git archive` has no .git, and a
    device machine's copy of the working tree may carry a .git that lags its files (its HEAD
    the session's first commit); git's own view is then kept beside it. Nulls where the package
    is not a tracked file of a git checkout (e.g. installed into site-packages)."""
    exported = os.environ.get("BATCHRUN_SOURCE_COMMIT")
    if _run(["git", "ls-files", "--error-unmatch", "__init__.py"], package) is None:
        return {"commit": exported, "dirty": False if exported else None}
    commit = _run(["git", "rev-parse", "HEAD"], package)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], package)
    dirty = None if status is None else bool(status)
    if exported and exported != commit:
        return {"commit": exported, "dirty": None, "git_head": commit, "git_dirty": dirty}
    return {"commit": commit, "dirty": dirty}


def _device() -> dict[str, Any]:
    """The GPU's name and driver where CUDA is there, else the CPU's model."""
    if torch.cuda.is_available():
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], Path())
        return {
            "name": torch.cuda.get_device_name(),
            "driver": driver.splitlines()[0] if driver else None,
            "cuda": torch.version.cuda,
        }
    return {"name": _cpu_model(), "driver": None, "cuda": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
