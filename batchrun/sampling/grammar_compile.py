"""Grammars compiled off the step loop, in processes of their own (compile_worker.py): the
engine's thread decodes meanwhile, a compile past its time budget is ended by killing its
process, and a compile under way at exit ends with the process (a thread could be neither
stopped nor left running: xgrammar's call returning into a finalizing interpreter aborts it).

One compile per distinct constraint text (a cache of compiles under way, results and failures),
each held to a budget: a constraint text over `max_constraint_bytes` is refused before
compiling, and a compile that runs past `grammar_compile_timeout` seconds is given up.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.sampling.compile_worker import READY, receive, send

# The job keys' defaults. A schema of 70,000 enum strings (1.1 MB) compiles for minutes at
# Qwen3's vocabulary, one nested 1,000 deep (30 KB) for 78 s; an ordinary one in milliseconds.
COMPILE_SECONDS = 60.0
MAX_CONSTRAINT_BYTES = 1_000_000
COMPILE_PROCESSES = 2  # compiles at once: the engine's own thread needs a core for the masks
CACHE_BYTES = 1 << 30  # compiled grammars and constraint texts kept for constraints seen again
# The compile process: `python WORKER...` (a test may run its own).
WORKER: tuple[str, ...] = ("-m", "batchrun.sampling.compile_worker")
_ROOT = str(Path(__file__).resolve().parents[2])  # where the process imports batchrun from

_LIVE: set[subprocess.Popen[bytes]] = set()  # killed at exit, whatever they are doing


@atexit.register
def _kill_live() -> None:
    for process in list(_LIVE):
        process.kill()


def _ask(process: subprocess.Popen[bytes], message: Any) -> tuple[Any, str | None] | None:
    """The process's answer to the message: (result, None) or (None, why not); None when the
    process is gone (killed, or it died)."""
    try:
        send(process.stdin, message)
        answer: tuple[Any, str | None] = receive(process.stdout)
    except (OSError, EOFError, ValueError):  # ValueError: a pipe closed on this side
        return None
    return answer


@dataclass(frozen=True)
class CompileBudget:
    seconds: float | None = COMPILE_SECONDS  # grammar_compile_timeout (None: no limit)
    max_bytes: int = MAX_CONSTRAINT_BYTES  # max_constraint_bytes: of the text compiled


class CompileJob:
    """One constraint's compile, shared by every row with that constraint: under way, then done
    with its result (the compiled grammar as JSON), or with the error that says why it has
    none. `grammar` is for the consumer to keep the grammar made of the result."""

    def __init__(self, what: str, payload: Any, cost: int) -> None:
        self.what = what  # the constraint's kind, for messages
        self.payload = payload  # what the compile process compiles
        self.cost = cost  # bytes the cache counts for it: its text, then its result
        self.started: float | None = None  # when a process took it (time.monotonic)
        self.process: subprocess.Popen[bytes] | None = None  # the one compiling it
        self.result: Any = None
        self.error: str | None = None
        self.done = False
        self.grammar: Any = None

    def _finish(self, result: Any, error: str | None) -> None:
        self.result, self.error, self.done = result, error, True
        self.payload = self.process = None


class CompilePool:
    """Compiles in COMPILE_PROCESSES processes, each fed by a daemon thread, under a budget,
    cached by the constraint's key."""

    def __init__(
        self,
        budget: CompileBudget,
        setup: Any,
        processes: int = COMPILE_PROCESSES,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        """setup: what each compile process is sent first (the tokenizer's description)."""
        self.budget, self.setup = budget, setup
        self.processes, self.cache_bytes = processes, cache_bytes
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._running: list[CompileJob] = []
        self._cache: OrderedDict[Hashable, CompileJob] = OrderedDict()
        self._cached = 0  # bytes of the cache's entries
        self._feeders = self._idle = 0  # threads, each with its process; those waiting for work
        self._processes: set[subprocess.Popen[bytes]] = set()
        self._closed = False

    def submit(self, key: Hashable, what: str, text_bytes: int, payload: Any) -> CompileJob:
        """The compile of the constraint `key` (what: its kind; text_bytes: the size of its
        text; payload: what the process compiles), queued unless one is cached or under way;
        at once an error when it breaks the size budget."""
        limit = self.budget.max_bytes
        if text_bytes > limit:
            job = CompileJob(what, None, 0)
            over = f"{what} is {text_bytes:,} bytes, more than max_constraint_bytes ({limit:,})"
            job._finish(None, over)
            return job
        with self._cond:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            job = CompileJob(what, payload, text_bytes)
            self._cache[key] = job
            self._cached += job.cost
            self._queue.append(job)
            if self._idle == 0 and self._feeders < self.processes:  # another process, at need
                self._feeders += 1
                threading.Thread(target=self._feed, name="batchrun-grammar", daemon=True).start()
            self._cond.notify_all()
        return job

    def close(self) -> None:
        """No more compiles: the processes end (killed mid-compile), their threads with them."""
        with self._cond:
            self._closed = True
            for process in self._processes:
                process.kill()
            self._cond.notify_all()

    def poll(self, job: CompileJob) -> bool:
        """Whether the compile is over, its time budget applied."""
        if not job.done:
            with self._cond:
                self._expire()
        return job.done

    def wait(self, jobs: Sequence[CompileJob], seconds: float | None) -> None:
        """Until one of `jobs` is over, or `seconds` have passed (None: no limit)."""
        end = None if seconds is None else time.monotonic() + seconds
        with self._cond:
            while True:
                self._expire()
                now = time.monotonic()
                if any(job.done for job in jobs) or (end is not None and now >= end):
                    return
                deadlines = [d for d in (end, self._next_expiry()) if d is not None]
                self._cond.wait(max(min(deadlines) - now, 0) if deadlines else None)

    def _feed(self) -> None:
        """One compile process's thread: a process started (again after one was killed or
        died), then the queue's compiles sent to it one at a time."""
        process: subprocess.Popen[bytes] | str | None = None
        while True:
            if process is None:
                process = self._start()
            with self._cond:
                self._idle += 1
                while not (self._queue or self._closed):
                    self._cond.wait()
                self._idle -= 1
                if self._closed:
                    break
                job = self._queue.popleft()
                if not isinstance(process, str):
                    job.started, job.process = time.monotonic(), process
                    self._running.append(job)
                    self._cond.notify_all()  # waiters now have a deadline to wake at
            answer: tuple[Any, str | None] | None
            if isinstance(process, str):  # none to compile it: the rows say why
                answer = None, f"{job.what} cannot be compiled: {process}"
            else:
                answer = _ask(process, job.payload)
            with self._cond:
                given_up = job.done  # its process killed
                if not given_up:
                    if job in self._running:
                        self._running.remove(job)
                    died = f"{job.what} cannot be compiled: its compile process died"
                    job._finish(*(answer or (None, died)))
                    self._account(job)
                self._cond.notify_all()
            if isinstance(process, str) or given_up or answer is None:
                if not isinstance(process, str):
                    self._retire(process)
                process = None
        if not isinstance(process, str):
            self._retire(process)

    def _start(self) -> subprocess.Popen[bytes] | str:
        """A compile process, ready, or why there is none."""
        paths = [_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        process = subprocess.Popen(
            [sys.executable, *WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C is the job's to handle, not its
        )
        with self._cond:
            self._processes.add(process)
            _LIVE.add(process)
            if self._closed:
                process.kill()
        if _ask(process, self.setup) == (READY, None):
            return process
        self._retire(process)
        return f"its compile process did not start (exit status {process.returncode})"

    def _retire(self, process: subprocess.Popen[bytes] | None) -> None:
        """A compile process that will not be sent more: ended (killed if need be) and
        reaped."""
        if process is None:
            return
        process.kill()
        process.wait()
        with self._cond:
            self._processes.discard(process)
            _LIVE.discard(process)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def _expire(self) -> None:
        """Give up the compiles past their time budget: their processes are killed."""
        seconds = self.budget.seconds
        if seconds is None or not self._running:
            return
        now = time.monotonic()
        late = [job for job in self._running if now - (job.started or now) > seconds]
        why = f"did not compile within grammar_compile_timeout ({seconds:g} s)"
        for job in late:
            self._running.remove(job)
            if job.process is not None:
                job.process.kill()  # its thread sees it gone and starts another
            job._finish(None, f"{job.what} {why}")
        if late:
            self._cond.notify_all()

    def _next_expiry(self) -> float | None:
        seconds = self.budget.seconds
        starts = [job.started for job in self._running if job.started is not None]
        return min(starts) + seconds if seconds is not None and starts else None

    def _account(self, job: CompileJob) -> None:
        """A finished compile's result joins the cache's count; the least recently used
        finished entries leave while the count is over its bytes."""
        if isinstance(job.result, str):
            job.cost += len(job.result)
            self._cached += len(job.result)
        for key in list(self._cache):
            if self._cached <= self.cache_bytes:
                break
            old = self._cache[key]
            if old.done and old is not job:
                del self._cache[key]
                self._cached -= old.cost
