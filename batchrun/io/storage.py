"""Object storage through pyarrow's filesystem layer: which specs are object-store URIs
(s3://bucket/key, gs://bucket/key), the filesystem that reaches them, configured by the standard
environment, and one-line errors for what goes wrong on the way (an endpoint that does not answer,
no credentials, a bucket that does not exist).

S3 is configured as the AWS tools are: AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for an
S3-compatible server, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or a profile
(AWS_PROFILE, ~/.aws/credentials and ~/.aws/config), AWS_REGION or AWS_DEFAULT_REGION. pyarrow
reads AWS_ENDPOINT_URL itself only in recent versions, so the endpoint and region are passed to it
explicitly. gs:// uses pyarrow's GCS filesystem and Google's default credentials.
"""

from __future__ import annotations

import configparser
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from batchrun.errors import JobError

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
        return _s3_filesystem(
            s3_endpoint(), os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        )
    try:
        return _gcs_filesystem()
    except (ImportError, pa.ArrowException) as exc:
        raise JobError(f"gs:// needs pyarrow built with GCS support: {exc}") from None


def s3_endpoint() -> str | None:
    """The S3 endpoint the environment names (None: AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


@functools.cache
def _s3_filesystem(endpoint: str | None, region: str | None) -> pafs.FileSystem:
    options: dict[str, str] = {}
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
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


# What the AWS SDK's error codes (in pyarrow's messages) mean, in the words of the line batchrun
# prints; the first that a message holds is the one said.
_AWS_ERRORS = (
    ("NETWORK_CONNECTION", "cannot connect to the object store{endpoint}"),
    ("NO_SUCH_BUCKET", "bucket {bucket!r} does not exist"),
    ("INVALID_ACCESS_KEY_ID", "the store does not know the access key (AWS_ACCESS_KEY_ID)"),
    ("SIGNATURE_DOES_NOT_MATCH", "the store refused the secret key (AWS_SECRET_ACCESS_KEY)"),
    ("ACCESS_DENIED", "access denied (check the credentials and the bucket's permissions)"),
)


def storage_reason(exc: BaseException, location: ObjectLocation) -> str:
    """Why an object-store call failed, in one line."""
    text = str(exc)
    for code, reason in _AWS_ERRORS:
        if code in text:
            endpoint = s3_endpoint() if location.scheme == "s3" else None
            return reason.format(
                endpoint=f" at {endpoint}" if endpoint else "", bucket=location.bucket
            )
    if "HTTP response code: 403" in text:
        return _AWS_ERRORS[-1][1]
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return re.sub(r"\s*\(Request ID: [^)]*\)", "", first)
