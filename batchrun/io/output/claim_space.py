"""Where claims live, behind one interface (ClaimSpace), so that the claim protocol
(batchrun.io.output.claim) runs one code path over either: a directory (a local output's _claims,
or an object-store output's claims_dir: DirectoryClaims, here) or a bucket prefix (an s3://
output's _claims: batchrun.io.output.bucket_claims, through S3's conditional writes).

Of a space the protocol needs only: create a claim file exclusively (losing to another's of that
name is a clean False), list the claim files with their heartbeat times, read one, refresh one's
heartbeat only while it exists (a claim deleted as stale is never brought back), delete one.
Store failures are OSErrors of one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchrun.errors import JobError
from batchrun.io.parts import refuse_symlink, remove

CLAIM_SUFFIX = ".claim"


@dataclass(frozen=True)
class ClaimEntry:
    """A claim file as listed: its name, its last heartbeat (seconds since the epoch), its text."""

    name: str
    mtime: float
    text: str


class ClaimSpace(ABC):
    """A place holding claim files (names ending CLAIM_SUFFIX) and child spaces."""

    @property
    @abstractmethod
    def shown(self) -> str:
        """The space as messages name it: a path, or a URI."""

    @abstractmethod
    def prepare(self) -> None:
        """Make the space ready to hold claims (a directory: made, never through a symlink);
        JobError (one line) if it cannot be."""

    @abstractmethod
    def create(self, name: str, text: str) -> bool:
        """Create the file `name` holding text, unless one of that name exists: then False, or
        True if it holds this very text (claim texts are unique: a retried create's own)."""

    @abstractmethod
    def entries(self) -> Iterator[ClaimEntry]:
        """The claim files directly in the space (those gone while listed are left out)."""

    @abstractmethod
    def read(self, name: str) -> str:
        """A claim file's text; FileNotFoundError if it is gone."""

    @abstractmethod
    def beat(self, name: str) -> bool:
        """Refresh the heartbeat of a claim file this process created; False if it is gone
        (deleted as stale: it stays gone)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete a claim file if present."""

    @abstractmethod
    def child(self, name: str) -> ClaimSpace:
        """The space `name` inside this one (a chunk's claims of a multi-worker job)."""

    @abstractmethod
    def remove_all(self) -> None:
        """Delete the space's claim files and its children's, if any."""


class DirectoryClaims(ClaimSpace):
    """Claim files in a directory: built for shared cluster filesystems (NFS, Lustre), where
    flock/fcntl locks are unreliable, so only O_EXCL creation, listings, reads and mtimes."""

    def __init__(self, directory: Path, creating: str | None = None) -> None:
        """creating: what making the directory makes, in messages (a local output's _claims
        makes the output directory); by default the claims directory itself."""
        self.directory = directory
        self.creating = creating or f"claims directory {str(directory)!r}"

    @property
    def shown(self) -> str:
        return str(self.directory)

    def prepare(self) -> None:
        refuse_symlink(self.directory)  # its claims would be made and deleted elsewhere
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JobError(f"cannot create {self.creating}: {exc.strerror or exc}") from exc

    def create(self, name: str, text: str) -> bool:
        try:
            fd = os.open(self.directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                return self.read(name) == text
            except FileNotFoundError:
                return False
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def entries(self) -> Iterator[ClaimEntry]:
        for path in self.directory.glob("*" + CLAIM_SUFFIX):
            try:
                mtime = path.stat().st_mtime
                text = path.read_text()
            except FileNotFoundError:
                continue  # released or taken over meanwhile
            yield ClaimEntry(path.name, mtime, text)

    def read(self, name: str) -> str:
        return (self.directory / name).read_text()

    def beat(self, name: str) -> bool:
        try:
            os.utime(self.directory / name)
        except FileNotFoundError:
            return False
        return True

    def remove(self, name: str) -> None:
        remove(self.directory / name)

    def child(self, name: str) -> DirectoryClaims:
        return DirectoryClaims(self.directory / name)

    def remove_all(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.directory)
