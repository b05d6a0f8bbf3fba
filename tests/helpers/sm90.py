"""Compiles Triton kernels for Hopper (sm_90) in a subprocess, ahead of time and without a GPU:
Triton's compiler, not its interpreter (which the kernel tests set and which runs what the
compiler refuses), from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_offline(*args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` (a compile check: batchrun.kernels.compile_check or a helper script) with
    TRITON_INTERPRET unset and the repository first on the path; its output captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
