"""SIGTERM and SIGINT stop a run cleanly: what is finished is committed, and the next run of the
same command does the rest."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from batchrun.errors import JobStopped, signal_name

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT while run_job runs. Handlers are set in the main thread only (run_job
    elsewhere keeps the process's own), not for a signal that is ignored (SIGINT of a job started
    with `&`), and the ones found are put back after the run.

    Start-up (checks, claim, model loading) holds nothing to commit: a signal raises JobStopped
    where the main thread is. Once the run loop runs (defer()), the handler only records the
    signal, and the loop stops before its next step: it admits no more rows, drops the requests
    in flight (the next run redoes them), commits the rows finished so far, writes stats.json
    and raises JobStopped, which `batchrun run` prints as one line before it exits
    EXIT_STOPPED. While the loop waits for input rows (raising()), which holds nothing, a signal
    raises at once, so a slow read or tokenization never holds the stop up. A second signal ends
    the process at once (the default action): a part is committed by a rename, so no
    half-written part is left, its temp file is deleted by the next start, and the next run
    takes the claim of the dead process over.

    lockstep (tensor-parallel ranks): a signal is only recorded, in start-up too, and the ranks
    stop together at a step where one of them has one (LocalRun._stopping). Later signals are
    ignored: torchrun passes its signal on to ranks that the scheduler may have signalled
    already, and kills them itself after its shutdown timeout.
    """

    def __init__(self, lockstep: bool = False) -> None:
        self.signum: int | None = None
        self.lockstep = lockstep
        self._raises = not lockstep
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._install({s: signal.SIG_DFL if p is None else p for s, p in self._previous.items()})
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:  # a second signal that came while the first switched over
            if self.lockstep:
                return
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)  # its default action: the process ends here
        self.signum = signum
        then = signal.SIG_IGN if self.lockstep else signal.SIG_DFL
        self._install(dict.fromkeys(self._previous, then))
        if self._raises:
            raise JobStopped(signum)

    def _install(self, handlers: dict[int, Any]) -> None:
        """Sets handlers with their signals blocked: one that comes meanwhile is delivered to the
        new handler when they are unblocked. (Set unblocked, a signal that came between Python's
        check for pending signals and the switch would be dropped with an 'ignored due to race
        condition' traceback on stderr.)"""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, handlers)
        try:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def defer(self) -> None:
        """From now on a signal is only recorded: the run loop acts on it."""
        self._raises = False

    @contextlib.contextmanager
    def raising(self) -> Iterator[None]:
        """Within: a signal, or one recorded before, raises JobStopped (for waits that hold
        nothing). Not in lockstep: the ranks stop only where they agree."""
        if self.lockstep:
            yield
            return
        self._raises = True
        try:
            if self.signum is not None:
                raise JobStopped(self.signum)
            yield
        finally:
            self._raises = False


def stop_line(signum: int, committed: int, this_run: int, left: int, overwrite: bool) -> str:
    """What `batchrun run` prints on stderr when a signal stopped it (rows: input rows of the
    job, or of its shard). The same command resumes, unless it overwrites."""
    again = "with --no-overwrite" if overwrite else "again"
    return (
        f"batchrun: stopped by {signal_name(signum)}: {committed} rows committed "
        f"({this_run} in this run), {left} left for the next run; "
        f"run the same command {again} to resume"
    )
