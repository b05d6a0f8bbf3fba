"""Files local or in object storage behind one interface (Store), so that the input listing and
reader and the output directory run one code path (batchrun.io.input, batchrun.io.output).

A local store writes a file under a temp name, fsyncs it and renames it into place, and never
writes, replaces or deletes through a symlink. An object store has no rename and needs none: an
object appears under its final name only when its upload completes (a killed upload leaves
nothing), so each file is written once, whole, under its final name. A part is serialized in
memory first, so a failure while building it never completes an upload of half a part.

Paths are PurePath: a Path locally, a PurePosixPath "bucket/key/..." in an object store.

Object stores are reached through pyarrow's filesystem layer: which specs are object-store URIs
(s3://bucket/key, gs://bucket/key), the filesystem that reaches them, configured by the standard
environment, and one-line errors for what goes wrong on the way (an endpoint that does not answer,
no credentials, a bucket that does not exist).

S3 is configured as the AWS tools are: AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for an
S3-compatible server, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or a profile
(AWS_PROFILE, ~/.aws/credentials and ~/.aws/config), AWS_REGION or AWS_DEFAULT_REGION. pyarrow
reads AWS_ENDPOINT_URL itself only in recent versions, so the endpoint and region are passed to it
explicitly (s3_endpoint_url, s3_region: also for boto3, which keeps an s3:// output's claims in
its bucket, batchrun.io.output.bucket_claims). gs:// uses pyarrow's GCS filesystem and Google's
default credentials.
"""

from __future__ import annotations

import configparser
import contextlib
import functools
import glob
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePath, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchrun.errors import JobError
from batchrun.io.parts import refuse_symlink, remove, write_part, write_text_atomically

OBJECT_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs"}  # as written -> the canonical one


def is_uri(spec: str) -> bool:
    """Whether spec names an object in object storage (s3://, gs://) rather than a local path."""
    scheme, sep, _ = spec.partition("://")
    return bool(sep) and scheme.lower() in OBJECT_SCHEMES


@dataclass(frozen=True)
class ObjectLocation:
    """An object-store URI split: its scheme (s3 or gs) and its filesystem path, bucket/key."""

    scheme: str
    path: str  # "bucket" or "bucket/key/...", without a trailing slash

    @classmethod
    def parse(cls, spec: str) -> ObjectLocation:
        scheme, _, rest = spec.partition("://")
        path = rest.strip("/")
        if not path or path.startswith(".") or "//" in path:
            raise JobError(f"{spec!r} is not an object-store URI of the form {scheme}://bucket/key")
        return cls(OBJECT_SCHEMES[scheme.lower()], path)

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.path}"


def object_filesystem(scheme: str) -> pafs.FileSystem:
    """The filesystem of an object-store scheme, configured from the environment; JobError (one
    line) when it cannot be made (no credentials, a build of pyarrow without it)."""
    if scheme == "s3":
        _require_aws_credentials()
        return _s3_filesystem(s3_endpoint_url(), s3_region())
    try:
        return _gcs_filesystem()
    except (ImportError, pa.ArrowException) as exc:
        raise JobError(f"gs:// needs pyarrow built with GCS support: {exc}") from None


def s3_endpoint() -> str | None:
    """The S3 endpoint the environment names (None: AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_endpoint_url() -> str | None:
    """The S3 endpoint as a URL (an endpoint named without a scheme is reached over https)."""
    endpoint = s3_endpoint()
    return endpoint if endpoint is None or "://" in endpoint else f"https://{endpoint}"


def s3_region() -> str | None:
    """The AWS region the environment names (None: the SDK's default)."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


@functools.cache
def _s3_filesystem(endpoint: str | None, region: str | None) -> pafs.FileSystem:
    options: dict[str, str] = {}
    if endpoint:
        parts = urlsplit(endpoint)
        options["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        options["scheme"] = parts.scheme
    if region:
        options["region"] = region
    return pafs.S3FileSystem(**options)


@functools.cache
def _gcs_filesystem() -> pafs.FileSystem:
    return pafs.GcsFileSystem()


def _require_aws_credentials() -> None:
    """JobError unless the AWS credential chain has a source to take credentials from.

    Without one, the AWS SDK sends unsigned requests, which a store refuses with an 'access
    denied' that does not say why. Instance metadata (EC2, ECS roles) is a source unless
    AWS_EC2_METADATA_DISABLED is true, so on a machine where it may answer the check passes."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return
    sources = (
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    )
    if any(env.get(name) for name in sources) or _aws_profile_exists():
        return
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        return  # the instance's role may answer
    raise JobError(
        "no AWS credentials found for s3://: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "or AWS_PROFILE naming a profile in ~/.aws/credentials"
    )


def _aws_profile_exists() -> bool:
    """Whether the profile the SDK would use (AWS_PROFILE, else default) is in the shared files."""
    profile = os.environ.get("AWS_PROFILE") or "default"
    home = Path.home() / ".aws"
    files = {
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or str(home / "credentials"): profile,
        os.environ.get("AWS_CONFIG_FILE") or str(home / "config"): (
            profile if profile == "default" else f"profile {profile}"
        ),
    }
    for path, section in files.items():
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.has_section(section):
            return True
    return False


# What the AWS SDK's error codes mean, in the words of the line batchrun prints: as pyarrow's
# messages spell them, then as boto3's (the claims in a bucket, batchrun.io.output.bucket_claims);
# the first that a message holds is the one said.
_AWS_ERRORS = (
    (("NETWORK_CONNECTION", "Could not connect"), "cannot connect to the object store{endpoint}"),
    (("NO_SUCH_BUCKET", "(NoSuchBucket)"), "bucket {bucket!r} does not exist"),
    (
        ("INVALID_ACCESS_KEY_ID", "(InvalidAccessKeyId)"),
        "the store does not know the access key (AWS_ACCESS_KEY_ID)",
    ),
    (
        ("SIGNATURE_DOES_NOT_MATCH", "(SignatureDoesNotMatch)"),
        "the store refused the secret key (AWS_SECRET_ACCESS_KEY)",
    ),
    (
        ("ACCESS_DENIED", "(AccessDenied)"),
        "access denied (check the credentials and the bucket's permissions)",
    ),
)


def storage_reason(exc: BaseException, location: ObjectLocation) -> str:
    """Why an object-store call failed, in one line."""
    text = str(exc)
    for codes, reason in _AWS_ERRORS:
        if any(code in text for code in codes):
            endpoint = s3_endpoint() if location.scheme == "s3" else None
            return reason.format(
                endpoint=f" at {endpoint}" if endpoint else "", bucket=location.bucket
            )
    if "HTTP response code: 403" in text:
        return _AWS_ERRORS[-1][1]
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return re.sub(r"\s*\(Request ID: [^)]*\)", "", first)


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
    def holds(self, spec: str) -> bool:
        """Whether a spec (a local path or a URI) names a path in this store."""

    @abstractmethod
    def under(self, directory: PurePath) -> Callable[[PurePath], bool]:
        """A test of whether a path lies under directory (locally as the OS reaches it, links
        resolved)."""

    @abstractmethod
    def absent_root(self, path: PurePath) -> str | None:
        """Why nothing can be at path because what holds it is absent (an object store's
        bucket), else None."""

    @abstractmethod
    def kind(self, path: PurePath) -> str:
        """'file', 'dir' or 'missing' (an object-store prefix holding objects is a 'dir')."""

    @abstractmethod
    def glob(self, directory: PurePath, pattern: str, recursive: bool = False) -> list[PurePath]:
        """Sorted: the entries directly in directory (every file below it, recursive; in an
        object store only objects) whose names match the pattern; [] if it does not exist."""

    @abstractmethod
    def match(self, pattern: PurePath) -> list[PurePath]:
        """Sorted: the files whose paths match a glob ('*', '?', '[...]' within one name, '**'
        across any number of them)."""

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

    def holds(self, spec: str) -> bool:
        return not is_uri(spec)

    def under(self, directory: PurePath) -> Callable[[PurePath], bool]:
        root = Path(directory).resolve()
        return lambda path: Path(path).resolve().is_relative_to(root)

    def absent_root(self, path: PurePath) -> str | None:
        return None

    def kind(self, path: PurePath) -> str:
        local = Path(path)
        return "dir" if local.is_dir() else "file" if local.exists() else "missing"

    def glob(self, directory: PurePath, pattern: str, recursive: bool = False) -> list[PurePath]:
        local = Path(directory)
        if not local.is_dir():
            return []
        found = (
            (p for p in local.rglob(pattern) if p.is_file()) if recursive else local.glob(pattern)
        )
        return sorted(found, key=str)

    def match(self, pattern: PurePath) -> list[PurePath]:
        found = (Path(p) for p in glob.glob(str(pattern), recursive=True))
        return sorted((p for p in found if p.is_file()), key=str)

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

    def holds(self, spec: str) -> bool:
        return is_uri(spec) and ObjectLocation.parse(spec).scheme == self.scheme

    def under(self, directory: PurePath) -> Callable[[PurePath], bool]:
        return lambda path: path.is_relative_to(directory)

    def absent_root(self, path: PurePath) -> str | None:
        bucket = path.parts[0]
        return (
            None
            if self.kind(PurePosixPath(bucket)) == "dir"
            else f"bucket {bucket!r} does not exist"
        )

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

    def match(self, pattern: PurePath) -> list[PurePath]:
        # No listing by pattern in an object store: every object below the pattern's fixed
        # prefix, matched name by name.
        names = pattern.parts
        fixed = next(i for i, name in enumerate(names) if glob.has_magic(name))
        base = PurePosixPath(*names[:fixed])
        return [
            path
            for path in self.glob(base, "*", recursive=True)
            if _matches(names[fixed:], path.relative_to(base).parts)
        ]

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


def _matches(pattern: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether a path's names match a glob's, name by name; '**' matches any number of names."""
    if not pattern:
        return not names
    if pattern[0] == "**":
        return any(_matches(pattern[1:], names[skip:]) for skip in range(len(names) + 1))
    return bool(names) and fnmatchcase(names[0], pattern[0]) and _matches(pattern[1:], names[1:])


LOCAL = LocalStore()


def store_for(spec: str) -> Store:
    """The store a spec (a local path or an object-store URI) lives in."""
    if is_uri(spec):
        return ObjectStore(ObjectLocation.parse(spec).scheme)
    return LOCAL
