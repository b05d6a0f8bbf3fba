"""The grammar compile process, `python -m batchrun.sampling.compile_worker`, which
grammar_compile.py starts (and kills, when a compile runs past its budget). It is sent the
tokenizer's xgrammar description, answers READY, then is sent constraints one at a time and
answers each with (the compiled grammar as JSON, None) or (None, why it does not compile).
Messages are pickles, each after its length, on its stdin and stdout; what it prints goes to
stderr. It ends when its input does, or with the process that started it (Linux).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys
from typing import IO, Any

READY = "ready"
_LENGTH = struct.Struct("<Q")


def send(stream: IO[bytes] | None, message: Any) -> None:
    if stream is None:
        raise ValueError("no pipe")
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def receive(stream: IO[bytes] | None) -> Any:
    """The next message; EOFError when the stream ends first."""
    if stream is None:
        raise ValueError("no pipe")
    (size,) = _LENGTH.unpack(_read(stream, _LENGTH.size))
    return pickle.loads(_read(stream, size))


def _read(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


def _end_with_parent() -> None:
    """SIGKILL when the process that started this one ends, however it ends (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the end of its input ends it


def main() -> None:
    parent = os.getppid()
    _end_with_parent()
    if os.getppid() != parent:  # it ended before the line above took effect
        return
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what xgrammar or Python prints goes to stderr
    questions = sys.stdin.buffer
    import xgrammar

    from batchrun.sampling import constraint as compiling

    try:
        info = xgrammar.TokenizerInfo.deserialize_json(receive(questions))
    except EOFError:
        return
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    send(answers, (READY, None))
    while True:
        try:
            constraint = receive(questions)
        except EOFError:
            return
        try:  # looked up each time: a test may hold a compile back
            compiled = compiling.compile_constraint(compiler, constraint)
        except compiling.GrammarError as exc:
            send(answers, (None, str(exc)))
        else:
            send(answers, (compiled.serialize_json(), None))


if __name__ == "__main__":
    main()
