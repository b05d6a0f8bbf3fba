"""xgrammar's C++ warnings caught as strings instead of reaching the terminal.

xgrammar warns on the process's stderr (file descriptor 2, from C++) when it compiles a
constraint it will only partly enforce ("ignoring multipleOf", "falling back to anyOf
semantics", "'^' ... is ignored"), and compiles it anyway. batchrun refuses such a constraint
with the warning as the reason, so it catches them: fd 2 points at a file while xgrammar runs,
and what else was written there meanwhile (another thread's progress bar or log line) is written
back to stderr afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

# "[12:34:56] /project/cpp/json_schema_converter.cc:1094: Warning: <message>"
_WARNING = re.compile(r"^\[[\d:]+\] \S+:\d+: Warning: (.*)$")
_LOCK = threading.Lock()  # fd 2 is the process's: one catch at a time


@contextlib.contextmanager
def xgrammar_warnings() -> Iterator[list[str]]:
    """A list that holds, once the block is over, the warnings xgrammar wrote during it."""
    warnings: list[str] = []
    with _LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield warnings
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            others = []
            for line in sink.read().decode("utf-8", "replace").splitlines(keepends=True):
                match = _WARNING.match(line.rstrip("\n"))
                if match:
                    warnings.append(match.group(1).strip())
                else:
                    others.append(line)
            data = "".join(others).encode()
            while data:
                data = data[os.write(2, data) :]
