"""Whether this process can make a local directory that a job writes in later (a claims
directory, a metrics textfile's): a check start-up makes (validate's too) without writing."""

from __future__ import annotations

import os
from pathlib import Path


def unmakeable(directory: Path) -> str | None:
    """Why `directory` cannot be made, or written in, by this process; None if it can. Its
    nearest ancestor that exists (itself, if it does) must be a directory this process may
    write in."""
    existing = directory
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{str(existing)!r} is not writable"
    return None
