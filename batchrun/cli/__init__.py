"""The `batchrun` command's entry point. It imports nothing heavy itself: a Ctrl-C in the seconds
torch and the commands take to import ends as a stop before the job started (one line,
EXIT_STOPPED), not as Python's KeyboardInterrupt traceback. `cli`, the command group
(commands.py), is imported on first use."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

from batchrun.errors import EXIT_STOPPED, not_started_line


def _stopped_while_importing(signum: int, _frame: FrameType | None) -> None:
    print(not_started_line(signum), file=sys.stderr)
    raise SystemExit(EXIT_STOPPED)


def main() -> None:
    previous = signal.signal(signal.SIGINT, _stopped_while_importing)
    import torch

    # Triton's kernels run on a CPU only in its interpreter, which triton chooses when it is
    # first imported: the entry point asks for it before anything imports triton.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from batchrun.cli.commands import cli

    signal.signal(signal.SIGINT, previous)  # from here on, each command handles its signals
    cli(prog_name="batchrun")


def __getattr__(name: str) -> Any:
    if name == "cli":
        from batchrun.cli.commands import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
