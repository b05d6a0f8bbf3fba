"""The file operations an output directory and the input reader need, on a local filesystem or
in object storage, so that both run one code path (batchrun.io.output_dir, batchrun.io.reader).

A local store writes a file under a temp name, fsyncs it and renames it into place, and never
writes, replaces or deletes through a symlink. An object store has no rename and needs none: an
object appears under its final name only when its upload completes (a killed upload leaves
nothing), so each file is written once, whole, under its final name. A part is serialized in
memory first, so a failure while building it never completes an upload of half a part.

Paths are PurePath: a Path locally, a PurePosixPath "bucket/key/..." in an object store.
"""

from __future__ import annotations

import contextlib
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchrun.io.parts import refuse_symlink, remove, write_part, write_text_atomically
from batchrun.io.storage import ObjectLocation, is_uri, object_filesystem, storage_reason


class Store(ABC):
    """Files under one root: see the module docstring."""

    local: bool

    @abstractmethod
    def path(self, spec: str) -> PurePath:
        """The store's path for a spec (a local path or a URI of this store)."""

    @abstractmethod
    def shown(self, path: PurePath) -> str:
        """The path as the user wrote it: a local path, or its URI."""

    @abstractmethod
    def kind(self, path: PurePath) -> str:
        """'file', 'dir' or 'missing' (an object-store prefix holding objects is a 'dir')."""

    @abstractmethod
    def glob(self, directory: PurePath, pattern: str, recursive: bool = False) -> list[PurePath]:
        """Sorted: the entries directly in directory (every file below it, recursive; in an
        object store only objects) whose names match the pattern; [] if it does not exist."""

    @abstractmethod
    def stat(self, path: PurePath) -> tuple[int, int]:
        """(size, mtime_ns); FileNotFoundError if absent."""

    @abstractmethod
    def open_input(self, path: PurePath) -> Any:
        """What pyarrow reads the file through (random access)."""

    @abstractmethod
    def read_bytes(self, path: PurePath) -> bytes:
        """The whole file; FileNotFoundError if absent."""

    @abstractmethod
    def write_text(self, path: PurePath, text: str) -> None:
        """Write a file whole, or leave what was there."""

    @abstractmethod
    def write_part(self, path: PurePath, table: pa.Table) -> None:
        """Write a Parquet part whole, or nothing."""

    @abstractmethod
    def remove(self, path: PurePath) -> None:
        """Delete a file if present."""

    @abstractmethod
    def remove_tree(self, directory: PurePath) -> None:
        """Delete a directory and everything in it, if present."""

    @abstractmethod
    def make_dir(self, directory: PurePath) -> None:
        """Make a directory and its parents (an object store has none to make)."""

    @abstractmethod
    def move(self, source: PurePath, target: PurePath) -> None:
        """Rename a file (an object store copies it, then deletes the source)."""

    def read_text(self, path: PurePath) -> str:
        return self.read_bytes(path).decode()

    def exists(self, path: PurePath) -> bool:
        return self.kind(path) != "missing"

    def read_metadata(self, path: PurePath) -> pq.FileMetaData:
        return pq.read_metadata(self.open_input(path))

    def read_schema(self, path: PurePath) -> pa.Schema:
        return pq.read_schema(self.open_input(path))

    def read_table(self, path: PurePath, columns: list[str]) -> pa.Table:
        return pq.read_table(self.open_input(path), columns=columns)


class LocalStore(Store):
    local = True

    def path(self, spec: str) -> Path:
        return Path(spec)

    def shown(self, path: PurePath) -> str:
        return str(path)

    def kind(self, path: PurePath) -> str:
        local = Path(path)
        return "dir" if local.is_dir() else "file" if local.exists() else "missing"

    def glob(self, directory: PurePath, pattern: str, recursive: bool = False) -> list[PurePath]:
        local = Path(directory)
        if not local.is_dir():
            return []
        found = local.rglob(pattern) if recursive else local.glob(pattern)
        return sorted(found, key=str)

    def stat(self, path: PurePath) -> tuple[int, int]:
        stat = Path(path).stat()
        return stat.st_size, stat.st_mtime_ns

    def open_input(self, path: PurePath) -> Any:
        return str(path)

    def read_bytes(self, path: PurePath) -> bytes:
        return Path(path).read_bytes()

    def write_text(self, path: PurePath, text: str) -> None:
        write_text_atomically(Path(path), text)

    def write_part(self, path: PurePath, table: pa.Table) -> None:
        write_part(Path(path), table)

    def remove(self, path: PurePath) -> None:
        remove(Path(path))

    def remove_tree(self, directory: PurePath) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def make_dir(self, directory: PurePath) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)

    def move(self, source: PurePath, target: PurePath) -> None:
        refuse_symlink(Path(source))
        Path(source).replace(target)


class ObjectStore(Store):
    """One bucket store (s3, gs) through its pyarrow filesystem. Every error an operation raises
    is an OSError of one line (FileNotFoundError for an object that is not there)."""

    local = False

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self.fs = object_filesystem(scheme)

    def path(self, spec: str) -> PurePosixPath:
        return PurePosixPath(ObjectLocation.parse(spec).path)

    def shown(self, path: PurePath) -> str:
        return f"{self.scheme}://{path}"

    @contextlib.contextmanager
    def _one_line(self, path: PurePath) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as exc:
            location = ObjectLocation(self.scheme, str(path))
            raise OSError(storage_reason(exc, location)) from None

    def kind(self, path: PurePath) -> str:
        with self._one_line(path):
            info = self.fs.get_file_info(str(path))
        if info.type == pafs.FileType.File:
            return "file"
        return "dir" if info.type == pafs.FileType.Directory else "missing"

    def glob(self, directory: PurePath, pattern: str, recursive: bool = False) -> list[PurePath]:
        selector = pafs.FileSelector(str(directory), allow_not_found=True, recursive=recursive)
        with self._one_line(directory):
            infos = self.fs.get_file_info(selector)
        found = [
            PurePosixPath(info.path)
            for info in infos
            if info.type == pafs.FileType.File and fnmatchcase(info.base_name, pattern)
        ]
        return sorted(found, key=str)

    def stat(self, path: PurePath) -> tuple[int, int]:
        with self._one_line(path):
            info = self.fs.get_file_info(str(path))
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(self.shown(path))
        return info.size or 0, info.mtime_ns or 0

    def open_input(self, path: PurePath) -> Any:
        with self._one_line(path):
            return self.fs.open_input_file(str(path))

    def read_bytes(self, path: PurePath) -> bytes:
        with self._one_line(path), self.fs.open_input_stream(str(path)) as stream:
            return bytes(stream.read())

    def _put(self, path: PurePath, data: bytes | pa.Buffer) -> None:
        with (
            self._one_line(path),
            self.fs.open_output_stream(str(path), compression=None) as stream,
        ):
            stream.write(data)

    def write_text(self, path: PurePath, text: str) -> None:
        self._put(path, text.encode())

    def write_part(self, path: PurePath, table: pa.Table) -> None:
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer)
        self._put(path, buffer.getvalue())

    def remove(self, path: PurePath) -> None:
        with contextlib.suppress(FileNotFoundError), self._one_line(path):
            self.fs.delete_file(str(path))

    def remove_tree(self, directory: PurePath) -> None:
        with self._one_line(directory):
            self.fs.delete_dir_contents(str(directory), missing_dir_ok=True)

    def make_dir(self, directory: PurePath) -> None:
        return  # prefixes exist as soon as an object is under them

    def move(self, source: PurePath, target: PurePath) -> None:
        with self._one_line(source):
            self.fs.move(str(source), str(target))


LOCAL = LocalStore()


def store_for(spec: str) -> Store:
    """The store a spec (a local path or an object-store URI) lives in."""
    if is_uri(spec):
        return ObjectStore(ObjectLocation.parse(spec).scheme)
    return LOCAL
