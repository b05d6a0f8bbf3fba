"""Claims kept in an s3:// output's own bucket (OUT/_claims/), so that runs on several nodes share
nothing but the bucket: a ClaimSpace (batchrun.io.output.claim_space) over S3's conditional
writes, through boto3 (pyarrow, which writes the Parquet, sends no conditions).

A claim file is created with PutObject `If-None-Match: *` (it never replaces an object: losing
to one of that name is PreconditionFailed, a clean False) and its heartbeat is a PutObject of the
same body with `If-Match: <its ETag>` (a claim deleted as stale answers NoSuchKey and stays gone;
an unconditional put would bring it back beside its taker's). A heartbeat is the object's
LastModified, read on this node's clock (by the response's Date), so a node whose clock is off
judges another's heartbeat as one with the right clock does. S3 lists and reads after a write
consistently, as the protocol needs.

boto3 (the `s3` extra) is imported only when a job's output is in S3 and keeps its claims there.
It reaches the store configured as pyarrow's S3 filesystem is (batchrun.io.store:
AWS_ENDPOINT_URL, the region, the AWS credential chain).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from pathlib import PurePosixPath
from typing import Any

from batchrun.errors import JobError
from batchrun.io.output.claim_space import CLAIM_SUFFIX, ClaimEntry, ClaimSpace
from batchrun.io.store import ObjectLocation, s3_endpoint_url, s3_region, storage_reason

CLAIMS_IN_BUCKET = ("s3",)  # the schemes whose outputs keep their claims in the bucket
_TAKEN = ("PreconditionFailed", "ConditionalRequestConflict")  # a conditional put lost a race
_GONE = ("NoSuchKey", "404")


def require_boto3() -> None:
    """JobError (one line) unless boto3 is installed (checked without importing it)."""
    if importlib.util.find_spec("boto3") is None:
        raise JobError(
            "an s3:// output keeps its claims in its bucket through boto3, which is not "
            "installed: pip install 'batchrun[s3]' (or set claims_dir, --claims-dir, to a local "
            "or shared directory)"
        )


_CLIENT_LOCK = threading.Lock()  # boto3's default session makes clients one thread at a time


@functools.cache
def _client(endpoint: str | None, region: str | None) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard"})
    with _CLIENT_LOCK:
        return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


class _Taken(OSError):
    """A conditional put lost: an object of that name is there (If-None-Match), or another one
    than the one this run wrote (If-Match)."""


def _code(exc: BaseException) -> str | None:
    """The S3 error code of a boto3 ClientError (None for any other error)."""
    response = getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _local_time(stamp: float, response: dict[str, Any]) -> float:
    """A time of the store's clock (LastModified) on this node's, by the response's Date: how
    long ago a heartbeat was is then right also where the two clocks differ."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        store_now = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return stamp  # no Date: the clocks are taken to agree
    return stamp + time.time() - store_now


class BucketClaims(ClaimSpace):
    """Claim files under a prefix of an S3 bucket (`path`: bucket/key/...)."""

    def __init__(self, path: PurePosixPath) -> None:
        self.location = ObjectLocation("s3", str(path))
        self.bucket, _, self.prefix = self.location.path.partition("/")
        self._held: dict[str, tuple[bytes, str]] = {}  # name -> body, ETag of those created here
        self._lock = threading.Lock()  # _held: chunk claims are made on the reader thread

    @property
    def shown(self) -> str:
        return self.location.uri

    @property
    def _s3(self) -> Any:
        return _client(s3_endpoint_url(), s3_region())

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    @contextlib.contextmanager
    def _one_line(self) -> Iterator[None]:
        """boto3's errors as OSErrors of one line (its exceptions are no OSErrors)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError) as exc:
            code = _code(exc)
            if code in _GONE:
                raise FileNotFoundError(self.shown) from None
            if code in _TAKEN:
                raise _Taken(self.shown) from None
            raise OSError(storage_reason(exc, self.location)) from None

    def prepare(self) -> None:
        return  # a prefix exists as soon as an object is under it

    def create(self, name: str, text: str) -> bool:
        body = text.encode()
        try:
            with self._one_line():
                put = self._s3.put_object(
                    Bucket=self.bucket, Key=self._key(name), Body=body, IfNoneMatch="*"
                )
        except _Taken:
            # A put retried after its first try went through (its answer lost) finds its own
            # object: still this run's claim. Another body is another run's: taken.
            try:
                with self._one_line():
                    put = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
                    if put["Body"].read() != body:
                        return False
            except FileNotFoundError:
                return False  # the winner's, released since
        with self._lock:
            self._held[name] = (body, put["ETag"])
        return True

    def _names(self, recursive: bool) -> Iterator[str]:
        """The keys under the prefix (recursive: below it at any depth), relative to it."""
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket,
            Prefix=self.prefix + "/",
            **({} if recursive else {"Delimiter": "/"}),
        )
        with self._one_line():
            for page in pages:
                for item in page.get("Contents", []):
                    yield item["Key"][len(self.prefix) + 1 :]

    def entries(self) -> Iterator[ClaimEntry]:
        for name in list(self._names(recursive=False)):
            if not name.endswith(CLAIM_SUFFIX):
                continue
            try:
                with self._one_line():
                    got = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
                    text = got["Body"].read().decode(errors="replace")
            except FileNotFoundError:
                continue  # released or taken over meanwhile
            yield ClaimEntry(name, _local_time(got["LastModified"].timestamp(), got), text)

    def read(self, name: str) -> str:
        with self._one_line():
            got = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
            return str(got["Body"].read().decode(errors="replace"))

    def beat(self, name: str) -> bool:
        with self._lock:
            held = self._held.get(name)
        if held is None:
            return False  # not created here: no heartbeat of ours to refresh
        body, etag = held
        try:
            with self._one_line():
                key = self._key(name)
                self._s3.put_object(Bucket=self.bucket, Key=key, Body=body, IfMatch=etag)
        except (FileNotFoundError, _Taken):  # deleted as stale, or replaced by no claim of ours
            return False
        return True

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._one_line():
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))
        with self._lock:
            self._held.pop(name, None)

    def child(self, name: str) -> BucketClaims:
        return BucketClaims(PurePosixPath(self.location.path) / name)

    def remove_all(self) -> None:
        names = list(self._names(recursive=True))
        for start in range(0, len(names), 1000):  # DeleteObjects takes 1000 keys at most
            keys = [{"Key": self._key(name)} for name in names[start : start + 1000]]
            with self._one_line():
                self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
