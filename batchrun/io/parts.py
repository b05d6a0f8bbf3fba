"""Part file names and atomic writes: a file is either absent or complete, even across a kill."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PART_PATTERN = "part-*.parquet"  # every shard's parts
PROGRESS_DIR = "_progress"  # beside the parts: what is committed (batchrun.io.progress)
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
    # Hidden, and per process, so concurrent writers of the same name never share a temp file.
    return path.with_name(f".{path.name}.{os.getpid()}{_TEMP_SUFFIX}")


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(temp), fsync it, rename it to `path`, fsync the directory so the rename survives."""
    temp = temp_path(path)
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
