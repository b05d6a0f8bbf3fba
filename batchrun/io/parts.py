"""Part file names and atomic writes: a file is either absent or complete, even across a kill.

Inside an output directory batchrun never writes, replaces or deletes through a symlink (its
target may be anything, anywhere): write_atomically and remove refuse a symlink in one line.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import JobError

PART_PATTERN = "part-*.parquet"  # every shard's parts
PROGRESS_DIR = "_progress"  # beside the parts: what is committed (batchrun.io.output.directory)
STATS_FILE = "stats.json"
SUCCESS_FILE = "_SUCCESS"
REPORT_FILE = "report.html"
_TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class PartNames:
    """Names of one shard's parts: part-NNNNNN.parquet, or part-IIIII-of-NNNNN-NNNNNN.parquet."""

    shard: tuple[int, int] | None

    @property
    def tag(self) -> str:
        """What sets this shard's files apart: "" unsharded, else "IIIII-of-NNNNN"."""
        return "" if self.shard is None else f"{self.shard[0]:05d}-of-{self.shard[1]:05d}"

    @property
    def prefix(self) -> str:
        return "part-" if self.shard is None else f"part-{self.tag}-"

    def name(self, number: int) -> str:
        return f"{self.prefix}{number:06d}.parquet"

    def number(self, name: str) -> int | None:
        """The part number of one of this shard's part names, else None."""
        match = re.fullmatch(re.escape(self.prefix) + r"(\d{6})\.parquet", name)
        return int(match.group(1)) if match else None


def temp_path(path: Path) -> Path:
    # Hidden, per process and random: concurrent writers never share a temp file, and no one can
    # plant a symlink under the name beforehand (it is created with O_EXCL).
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}")


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


def is_output_file(name: str) -> bool:
    """Whether batchrun writes a file of this name at the top of an output directory."""
    return name in (STATS_FILE, SUCCESS_FILE, REPORT_FILE) or fnmatch(name, PART_PATTERN)


def refuse_symlink(path: Path) -> None:
    """JobError if path is a symlink: batchrun does not write, replace or delete through one."""
    if path.is_symlink():
        raise JobError(
            f"{str(path)!r} is a symlink; batchrun never writes, replaces or deletes through a "
            "symlink inside an output directory (remove it, or use another --output)"
        )


def remove(path: Path) -> None:
    """Delete a file batchrun owns, if present; JobError (nothing deleted) for a symlink."""
    refuse_symlink(path)
    path.unlink(missing_ok=True)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(temp), fsync it, rename it to `path`, fsync the directory so the rename survives.
    JobError if `path` is a symlink (a rename would replace the link, not write its target)."""
    refuse_symlink(path)
    temp = temp_path(path)
    os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # never a planted link
    try:
        write(temp)
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomically(path: Path, text: str) -> None:
    def write(temp: Path) -> None:
        temp.write_text(text)

    write_atomically(path, write)


def write_part(path: Path, table: pa.Table) -> None:
    write_atomically(path, lambda temp: pq.write_table(table, temp))
