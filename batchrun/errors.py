"""Errors that stop a job before any work (bad job file, missing model, unreadable input)."""


class JobError(Exception):
    """The job cannot run. The CLI prints the message as one line and exits non-zero."""
