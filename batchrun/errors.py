"""Errors that stop a job before any work (bad job file, missing model, unreadable input), and
the stop a signal asks for."""

import signal

# The exit status of a run stopped by SIGTERM or SIGINT after committing what it finished:
# EX_TEMPFAIL of sysexits.h, "try again later", which is what the next run does. One status for
# both signals, and not 128 + signum: a shell reports a process killed by the signal (no commit,
# no message) as 128 + signum too, so 143 or 130 could not say that the stop was clean.
EXIT_STOPPED = 75


class JobError(Exception):
    """The job cannot run. The CLI prints the message as one line and exits non-zero."""


class JobStopped(Exception):
    """A run stopped by SIGTERM or SIGINT: what it finished is committed, the rest is left to
    the next run of the same command. `line` is what `batchrun run` prints on stderr before it
    exits EXIT_STOPPED; None where another process speaks (a tensor-parallel rank but 0)."""

    def __init__(self, signum: int, line: str | None = None) -> None:
        super().__init__(line or signal_name(signum))
        self.signum = signum
        self.line = line


def not_started_line(signum: int) -> str:
    """What a run stopped by a signal before it started (nothing read, nothing written) says."""
    return (
        f"batchrun: stopped by {signal_name(signum)} before the job started; "
        "run the same command again to start it"
    )


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
